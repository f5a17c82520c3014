//! Log output of the native core: one `tracing` subscriber per process, writing to stderr.
//!
//! The daemon installs it at start; the Python extension installs it when it is imported, so
//! a training process sees its manager server's warnings, reconnects and heal progress next
//! to its Python log lines. Lines follow the layout of Python `logging` records:
//!
//! ```text
//! 2025-01-02 03:04:05,678 WARNING torchft.manager.server: [train_0:1b4e…/0] lighthouse heartbeat failed; retrying error="…"
//! ```
//!
//! (time in UTC, level, the Rust module as a dotted logger name, the process's replica group
//! id and group rank when known, the message and its fields). The level comes from
//! `TORCHFT_LOG`, else `RUST_LOG` (both in `EnvFilter` syntax: `info`,
//! `warn,torchft::manager=debug`, …), else the caller's default.

use std::fmt::Write as _;
use std::sync::{OnceLock, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Registry};

use crate::error::{Error, Result};

/// The variable that sets the native log level (preferred over `RUST_LOG`).
pub const ENV_LOG: &str = "TORCHFT_LOG";
/// The conventional Rust variable, used when `TORCHFT_LOG` is not set.
pub const ENV_RUST_LOG: &str = "RUST_LOG";

/// Who this process is, printed on every line once known (`replica_id/group_rank`).
static CONTEXT: RwLock<Option<String>> = RwLock::new(None);
/// Handle to change the level of the installed subscriber (see [`set_default_level`]).
static FILTER: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();

/// Where the level came from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// One of the variables, with its name.
    Env(&'static str),
    /// Neither variable is set: the caller's default applies.
    Default,
}

/// The filter directives to use and where they came from.
fn configured(lookup: impl Fn(&str) -> Option<String>) -> (Source, Option<String>) {
    for name in [ENV_LOG, ENV_RUST_LOG] {
        if let Some(v) = lookup(name).filter(|v| !v.trim().is_empty()) {
            return (Source::Env(name), Some(v));
        }
    }
    (Source::Default, None)
}

/// Parses `directives` as an `EnvFilter`, naming `var` in the error.
fn parse_filter(var: &str, directives: &str) -> Result<EnvFilter> {
    EnvFilter::builder().parse(directives).map_err(|e| {
        Error::InvalidArgument(format!("{var}={directives:?} is not a log filter: {e}"))
    })
}

/// Installs the process's subscriber: stderr, Python-style lines, level from `TORCHFT_LOG`,
/// else `RUST_LOG`, else `default_level`.
///
/// Does nothing if this process already has a subscriber (a second call, or a host program
/// that installed its own).
///
/// # Errors
/// `InvalidArgument` naming the variable when `TORCHFT_LOG`/`RUST_LOG` is not a valid filter.
pub fn init(default_level: &str) -> Result<()> {
    if FILTER.get().is_some() {
        return Ok(());
    }
    let filter = match configured(|k| std::env::var(k).ok()) {
        (Source::Env(var), Some(directives)) => parse_filter(var, &directives)?,
        _ => parse_filter("default level", default_level)?,
    };
    let (layer, handle) = reload::Layer::new(filter);
    let installed = tracing_subscriber::registry()
        .with(layer)
        .with(
            tracing_subscriber::fmt::layer()
                .event_format(PythonStyle)
                .with_writer(std::io::stderr)
                .with_ansi(false),
        )
        .try_init()
        .is_ok();
    if installed {
        let _ = FILTER.set(handle);
    }
    Ok(())
}

/// Changes the level used when neither variable is set (e.g. the lighthouse daemon started
/// from the Python console script logs at `info`, a training process at `warn`).
///
/// # Errors
/// `InvalidArgument` when `level` is not a valid filter.
pub fn set_default_level(level: &str) -> Result<()> {
    let filter = parse_filter("default level", level)?;
    if configured(|k| std::env::var(k).ok()).0 != Source::Default {
        return Ok(());
    }
    if let Some(handle) = FILTER.get() {
        handle
            .reload(filter)
            .map_err(|e| Error::Unavailable(format!("cannot change the log level: {e}")))?;
    }
    Ok(())
}

/// Names this process on every following line: `[replica_id/group_rank]`.
pub fn set_context(replica_id: &str, group_rank: i64) {
    let mut ctx = CONTEXT.write().unwrap_or_else(|p| p.into_inner());
    *ctx = Some(format!("{replica_id}/{group_rank}"));
}

/// The context set by [`set_context`], if any.
pub fn context() -> Option<String> {
    CONTEXT.read().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Python `logging` level names.
fn level_name(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "ERROR",
        Level::WARN => "WARNING",
        Level::INFO => "INFO",
        Level::DEBUG => "DEBUG",
        Level::TRACE => "TRACE",
    }
}

/// `2025-01-02 03:04:05,678` in UTC, like Python's `%(asctime)s`.
fn asctime(now: SystemTime, out: &mut String) {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days since 1970-01-01 → civil date (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let _ = write!(
        out,
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02},{:03}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    );
}

/// Formats events as `asctime LEVEL logger: [replica/rank] message fields`.
struct PythonStyle;

impl<S, N> FormatEvent<S, N> for PythonStyle
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        let mut head = String::with_capacity(96);
        asctime(SystemTime::now(), &mut head);
        head.push(' ');
        head.push_str(level_name(meta.level()));
        head.push(' ');
        head.push_str(&meta.target().replace("::", "."));
        head.push_str(": ");
        if let Some(who) = context() {
            head.push('[');
            head.push_str(&who);
            head.push_str("] ");
        }
        writer.write_str(&head)?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn asctime_matches_python_layout() {
        let mut s = String::new();
        asctime(UNIX_EPOCH, &mut s);
        assert_eq!(s, "1970-01-01 00:00:00,000");
        s.clear();
        // 2024-02-29 23:59:59.123 UTC (a leap day).
        asctime(
            UNIX_EPOCH + Duration::from_millis(1_709_251_199_123),
            &mut s,
        );
        assert_eq!(s, "2024-02-29 23:59:59,123");
        s.clear();
        asctime(UNIX_EPOCH + Duration::from_secs(951_782_400), &mut s);
        assert_eq!(s, "2000-02-29 00:00:00,000");
    }

    #[test]
    fn torchft_log_wins_over_rust_log() {
        let env = |k: &str| match k {
            "TORCHFT_LOG" => Some("debug".to_string()),
            "RUST_LOG" => Some("error".to_string()),
            _ => None,
        };
        assert_eq!(
            configured(env),
            (Source::Env(ENV_LOG), Some("debug".into()))
        );
        let rust_only = |k: &str| (k == "RUST_LOG").then(|| "info".to_string());
        assert_eq!(
            configured(rust_only),
            (Source::Env(ENV_RUST_LOG), Some("info".into()))
        );
        let blank = |k: &str| (k == "TORCHFT_LOG").then(|| "  ".to_string());
        assert_eq!(configured(blank), (Source::Default, None));
    }

    #[test]
    fn bad_filter_names_the_variable() {
        let err = parse_filter(ENV_LOG, "torchft=loud")
            .unwrap_err()
            .to_string();
        assert!(err.contains("TORCHFT_LOG"), "{err}");
        assert!(parse_filter(ENV_LOG, "warn,torchft::manager=debug").is_ok());
    }

    #[test]
    fn level_names_are_pythons() {
        assert_eq!(level_name(&Level::WARN), "WARNING");
        assert_eq!(level_name(&Level::ERROR), "ERROR");
    }
}
