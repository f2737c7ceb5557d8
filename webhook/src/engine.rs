//! The pure rewrite engine (engine owner fills this in).
