//! Sweep configs that re-measure a shipped config must stay that config: everything outside
//! `[experiment]` and `[sweep]` equal, so a change to the shipped one cannot leave its
//! re-measurement behind.

use std::path::Path;

fn table(name: &str) -> toml::Table {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../experiments/configs")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut t: toml::Table = text
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    t.remove("experiment");
    t.remove("sweep");
    t
}

#[test]
fn the_load_and_balancer_sweep_is_service_toml() {
    let shipped = table("service.toml");
    let sweep = table("sweep-service-load-lb.toml");
    assert!(!shipped.is_empty());
    for (k, v) in &shipped {
        assert_eq!(sweep.get(k), Some(v), "key {k} differs from service.toml");
    }
    assert_eq!(
        shipped.len(),
        sweep.len(),
        "the sweep config has keys service.toml lacks"
    );
}
