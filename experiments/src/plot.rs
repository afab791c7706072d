//! Plots as SVG through plotters' SVG backend. SVG text is laid out by the viewer, so rendering
//! needs no system fonts at build or run time.

use anyhow::{Result, anyhow};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use std::path::Path;

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

pub fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plot: {e:?}")
}

/// Grouped bar chart: one group per category, one bar per series.
pub fn grouped_bars(
    path: &Path,
    title: &str,
    y_label: &str,
    categories: &[String],
    series: &[(String, Vec<f64>)],
) -> Result<()> {
    // Wide enough that every category's label fits under its group (about 7 px per character
    // at the axis font), so long case names do not run into each other.
    let longest = categories
        .iter()
        .map(|c| c.chars().count())
        .max()
        .unwrap_or(0);
    let width = (categories.len() as u32 * (longest as u32 * 7 + 16) + 120).max(960);
    let root = SVGBackend::new(path, (width, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let y_max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.45;
    let n = categories.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..n as f64, 0f64..y_max)
        .map_err(err)?;
    let cats = categories.to_vec();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 1e-6 && i < cats.len() {
                cats[i].clone()
            } else {
                String::new()
            }
        })
        .y_desc(y_label)
        .draw()
        .map_err(err)?;
    let k = series.len().max(1) as f64;
    let width = 0.8 / k;
    for (si, (name, values)) in series.iter().enumerate() {
        let c = color(si);
        chart
            .draw_series(values.iter().enumerate().map(|(ci, &v)| {
                let x0 = ci as f64 + 0.1 + si as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.92, v)], c.filled())
            }))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// What a line chart marks besides its series: a shaded x window (the measured part of a
/// run) and published references, each a level or a range of y, drawn dashed in the colour of
/// the series they belong to (`series` index).
#[derive(Clone, Debug, Default)]
pub struct Marks {
    pub window: Option<(String, f64, f64)>,
    pub references: Vec<Reference>,
}

#[derive(Clone, Debug)]
pub struct Reference {
    pub label: String,
    pub series: usize,
    pub low: f64,
    pub high: f64,
}

/// Line chart of several (x, y) series.
pub fn lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    lines_marked(path, title, x_label, y_label, series, &Marks::default())
}

/// [`lines`] with a measured window and reference levels (the y range includes them).
pub fn lines_marked(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    marks: &Marks,
) -> Result<()> {
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let refs = marks
        .references
        .iter()
        .flat_map(|r| [(f64::NAN, r.low), (f64::NAN, r.high)]);
    let pts = series
        .iter()
        .flat_map(|(_, p)| p.iter().copied())
        .chain(refs);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in pts {
        if x.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
        }
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1e-12 {
        x1 = x0 + 1.0;
    }
    let pad = ((y1 - y0) * 0.08).max(1e-9);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(err)?;
    draw_marks(&mut chart, marks, (x0, x1), (y0 - pad, y1 + pad))?;
    for (si, (name, p)) in series.iter().enumerate() {
        let c = color(si);
        chart
            .draw_series(LineSeries::new(p.iter().copied(), c.stroke_width(2)))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Draws `marks` (the shaded window, the reference levels and ranges) across the x range `xs`
/// and the y range `ys` of `chart`, under the series drawn after them.
fn draw_marks(
    chart: &mut ChartContext<'_, SVGBackend<'_>, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    marks: &Marks,
    (x0, x1): (f64, f64),
    (lo, hi): (f64, f64),
) -> Result<()> {
    if let Some((label, a, b)) = &marks.window {
        let grey = RGBColor(128, 128, 128);
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(a.max(x0), lo), (b.min(x1), hi)],
                grey.mix(0.12).filled(),
            )))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 16, y + 5)], grey.mix(0.3).filled())
            });
    }
    for r in &marks.references {
        let c = color(r.series);
        if r.high > r.low {
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x0, r.low), (x1, r.high)],
                    c.mix(0.12).filled(),
                )))
                .map_err(err)?;
        }
        let dashed = |y: f64| DashedLineSeries::new([(x0, y), (x1, y)], 8, 6, c.stroke_width(1));
        chart
            .draw_series(dashed(r.low))
            .map_err(err)?
            .label(r.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(1)));
        if r.high > r.low {
            chart.draw_series(dashed(r.high)).map_err(err)?;
        }
    }
    Ok(())
}

/// One point of a line with an interval: the mean and, when known, the interval's bounds.
#[derive(Clone, Copy, Debug)]
pub struct BandPoint {
    pub x: f64,
    pub mean: f64,
    pub low: Option<f64>,
    pub high: Option<f64>,
}

/// Tick text for a value on an axis spanning `span`: enough digits to tell ticks apart.
fn tick_text(v: f64, span: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-4..1e6).contains(&a) {
        return format!("{v:.2e}");
    }
    let decimals = if span > 0.0 {
        (2.0 - span.log10().floor()).clamp(0.0, 6.0) as usize
    } else {
        3
    };
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Means against a swept key, one line per series, each with its interval as a shaded band.
/// `xs` are the swept values (position, label as written): ticks sit exactly there. A numeric
/// key spanning two decades or more gets a log axis, and so does a metric; a key that is not
/// numeric is drawn as categories, with error bars instead of lines between them.
pub fn bands(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    xs: &[(f64, String)],
    numeric: bool,
    series: &[(String, Vec<BandPoint>)],
) -> Result<()> {
    let ax = BandAxes::new(xs, numeric, series);
    let root = SVGBackend::new(path, (1000, 580)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(18)
        .x_label_area_size(56)
        .y_label_area_size(84)
        .build_cartesian_2d(
            (ax.x0 - ax.xpad)..(ax.x1 + ax.xpad),
            (ax.y0 - ax.ypad)..(ax.y1 + ax.ypad),
        )
        .map_err(err)?;
    draw_band_mesh(&mut chart, &ax, x_label, y_label)?;
    draw_band_ticks(&root, &mut chart, &ax, xs)?;
    let k = series.len().max(1) as f64;
    for (si, (name, pts)) in series.iter().enumerate() {
        // Categories: series side by side around each tick.
        let off = if numeric {
            0.0
        } else {
            (si as f64 - (k - 1.0) / 2.0) * (0.5 / k)
        };
        draw_band_series(&mut chart, &ax, color(si), off, name, pts)?;
    }
    // The legend goes to the right-hand corner the lines leave free.
    let right: Vec<f64> = series
        .iter()
        .filter_map(|(_, p)| p.iter().max_by(|a, b| a.x.total_cmp(&b.x)))
        .map(|b| ax.ty(b.high.unwrap_or(b.mean)))
        .collect();
    let high_right = right.iter().any(|&y| y > ax.y0 + (ax.y1 - ax.y0) * 0.5);
    chart
        .configure_series_labels()
        .position(if high_right {
            SeriesLabelPosition::LowerRight
        } else {
            SeriesLabelPosition::UpperRight
        })
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

type BandChart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The axes of a band plot: which are logarithmic, the data range in plotted units, and the
/// padding around it.
struct BandAxes {
    numeric: bool,
    log_x: bool,
    log_y: bool,
    x0: f64,
    x1: f64,
    xpad: f64,
    y0: f64,
    y1: f64,
    ypad: f64,
    /// The span of the means and intervals in data units, for the tick text.
    yspan: f64,
}

impl BandAxes {
    fn new(xs: &[(f64, String)], numeric: bool, series: &[(String, Vec<BandPoint>)]) -> Self {
        let xv: Vec<f64> = xs.iter().map(|x| x.0).collect();
        let (xmin, xmax) = xv
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
        let log_x = numeric && xmin > 0.0 && xmax / xmin >= 50.0;
        let ys: Vec<f64> = series
            .iter()
            .flat_map(|(_, p)| p.iter().flat_map(|b| [Some(b.mean), b.low, b.high]))
            .flatten()
            .filter(|y| y.is_finite())
            .collect();
        let (ymin, ymax) = ys
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), &y| (l.min(y), h.max(y)));
        let (ymin, ymax) = if ys.is_empty() {
            (0.0, 1.0)
        } else {
            (ymin, ymax)
        };
        let log_y = ymin > 0.0 && ymax / ymin >= 100.0;
        let scale = |log: bool, v: f64| if log { v.log10() } else { v };
        let (x0, x1) = (scale(log_x, xmin), scale(log_x, xmax));
        let xpad = if numeric && x1 > x0 {
            (x1 - x0) * 0.06
        } else {
            0.5
        };
        let (y0, y1) = (scale(log_y, ymin), scale(log_y, ymax));
        let ypad = if y1 > y0 {
            (y1 - y0) * 0.08
        } else {
            y0.abs().max(1e-9) * 0.05
        };
        Self {
            numeric,
            log_x,
            log_y,
            x0,
            x1,
            xpad,
            y0,
            y1,
            ypad,
            yspan: ymax - ymin,
        }
    }

    fn tx(&self, x: f64) -> f64 {
        if self.log_x { x.log10() } else { x }
    }

    fn ty(&self, y: f64) -> f64 {
        if self.log_y { y.log10() } else { y }
    }
}

/// The axis descriptions and the y labels; the x ticks are drawn by `draw_band_ticks`.
fn draw_band_mesh(
    chart: &mut BandChart<'_, '_>,
    ax: &BandAxes,
    x_label: &str,
    y_label: &str,
) -> Result<()> {
    let (log_y, yspan) = (ax.log_y, ax.yspan);
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .x_desc(if ax.log_x {
            format!("{x_label} (log scale)")
        } else {
            x_label.to_string()
        })
        .y_desc(if log_y {
            format!("{y_label} (log scale)")
        } else {
            y_label.to_string()
        })
        .y_label_formatter(&|v| {
            if log_y {
                tick_text(10f64.powf(*v), 10f64.powf(*v))
            } else {
                tick_text(*v, yspan)
            }
        })
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(err)
}

/// Ticks at the swept values, labelled as written; thinned when crowded.
fn draw_band_ticks(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    chart: &mut BandChart<'_, '_>,
    ax: &BandAxes,
    xs: &[(f64, String)],
) -> Result<()> {
    let step = xs.len().div_ceil(14).max(1);
    let (ylo, yhi) = (ax.y0 - ax.ypad, ax.y1 + ax.ypad);
    for (i, (x, label)) in xs.iter().enumerate() {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(ax.tx(*x), ylo), (ax.tx(*x), yhi)],
                RGBColor(220, 220, 220).stroke_width(1),
            )))
            .map_err(err)?;
        if i % step != 0 {
            continue;
        }
        let (px, py) = chart.backend_coord(&(ax.tx(*x), ylo));
        root.draw(&Text::new(
            label.clone(),
            (px, py + 8),
            ("sans-serif", 15).into_font().color(&BLACK).pos(
                plotters::style::text_anchor::Pos::new(
                    plotters::style::text_anchor::HPos::Center,
                    plotters::style::text_anchor::VPos::Top,
                ),
            ),
        ))
        .map_err(err)?;
    }
    Ok(())
}

/// One series: its intervals (a band on a numeric axis, else error bars), the line through
/// its means on a numeric axis, and the means as dots carrying the legend entry. `off` shifts
/// the series sideways from the ticks.
fn draw_band_series(
    chart: &mut BandChart<'_, '_>,
    ax: &BandAxes,
    c: RGBColor,
    off: f64,
    name: &str,
    pts: &[BandPoint],
) -> Result<()> {
    let px = |b: &BandPoint| ax.tx(b.x) + off;
    let with_ci: Vec<&BandPoint> = pts
        .iter()
        .filter(|b| b.low.is_some() && b.high.is_some())
        .collect();
    if ax.numeric && with_ci.len() >= 2 {
        let mut poly: Vec<(f64, f64)> = with_ci
            .iter()
            .map(|b| (px(b), ax.ty(b.low.unwrap_or(b.mean))))
            .collect();
        poly.extend(
            with_ci
                .iter()
                .rev()
                .map(|b| (px(b), ax.ty(b.high.unwrap_or(b.mean)))),
        );
        chart
            .draw_series(std::iter::once(Polygon::new(poly, c.mix(0.18).filled())))
            .map_err(err)?;
    } else {
        // Error bars with caps.
        let cap = if ax.numeric { ax.xpad * 0.15 } else { 0.04 };
        for b in &with_ci {
            let (lo, hi) = (
                ax.ty(b.low.unwrap_or(b.mean)),
                ax.ty(b.high.unwrap_or(b.mean)),
            );
            let x = px(b);
            for seg in [
                vec![(x, lo), (x, hi)],
                vec![(x - cap, lo), (x + cap, lo)],
                vec![(x - cap, hi), (x + cap, hi)],
            ] {
                chart
                    .draw_series(std::iter::once(PathElement::new(seg, c.stroke_width(2))))
                    .map_err(err)?;
            }
        }
    }
    if ax.numeric {
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|b| (px(b), ax.ty(b.mean))),
                c.stroke_width(2),
            ))
            .map_err(err)?;
    }
    chart
        .draw_series(
            pts.iter()
                .map(|b| Circle::new((px(b), ax.ty(b.mean)), 4, c.filled())),
        )
        .map_err(err)?
        .label(name)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(3)));
    Ok(())
}
