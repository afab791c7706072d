//! Sans-IO engine state machines, step plans and the backend trait (simulator issue).
