//! The stall watchdog's settings and what it found: a streamed answer that goes
//! silent for `stream.stall_after` has stalled; with `stream.on_stall` set to
//! `error` or `reset`, promptgate ends it once the silence reaches
//! `stream.abort_after`, so the agent can retry. Silence is counted from the
//! request going upstream until the head, then from the last byte received
//! (Anthropic's `ping` events are bytes).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::setting::{Scalar, parse_duration};

/// What to do with a stalled stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnStall {
    /// Keep waiting (up to `--upstream-timeout` for the head, `--idle-timeout` after).
    Wait,
    /// End it: before any byte reached the client, with the provider's retryable
    /// error; mid-stream, with an SSE `error` event and an incomplete ending.
    Error,
    /// End it by cutting the connection (an incomplete ending, no event).
    Reset,
}

impl OnStall {
    pub fn name(self) -> &'static str {
        match self {
            OnStall::Wait => "wait",
            OnStall::Error => "error",
            OnStall::Reset => "reset",
        }
    }
}

/// `[stream]` in the config file, as written.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamLayer {
    pub stall_after: Option<Scalar>,
    pub on_stall: Option<String>,
    pub abort_after: Option<Scalar>,
}

/// The validated watchdog settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallSettings {
    pub stall_after: Duration,
    pub on_stall: OnStall,
    /// Counted from the start of the silence.
    pub abort_after: Duration,
}

impl Default for StallSettings {
    fn default() -> Self {
        StallSettings {
            stall_after: Duration::from_secs(30),
            on_stall: OnStall::Wait,
            abort_after: Duration::from_secs(120),
        }
    }
}

impl StallSettings {
    /// Applies a layer; the error names the setting and what was expected.
    pub fn apply(&mut self, layer: StreamLayer) -> Result<(), (&'static str, String)> {
        if let Some(v) = layer.stall_after {
            self.stall_after = parse_duration(&v).map_err(|m| ("stall-after", m.to_string()))?;
        }
        if let Some(v) = layer.abort_after {
            self.abort_after = parse_duration(&v).map_err(|m| ("abort-after", m.to_string()))?;
        }
        if let Some(v) = layer.on_stall {
            self.on_stall = match v.as_str() {
                "wait" => OnStall::Wait,
                "error" => OnStall::Error,
                "reset" => OnStall::Reset,
                _ => {
                    return Err((
                        "on-stall",
                        format!(
                            "{v:?} is not a stall action (expected \"wait\", \"error\" or \"reset\")"
                        ),
                    ));
                }
            };
        }
        if self.stall_after.is_zero() {
            return Err(("stall-after", "expected more than 0s (e.g. \"30s\")".into()));
        }
        if self.on_stall != OnStall::Wait && self.abort_after < self.stall_after {
            return Err((
                "abort-after",
                format!(
                    "{}s is shorter than stall_after ({}s): a stream is ended only once it has stalled",
                    self.abort_after.as_secs_f64(),
                    self.stall_after.as_secs_f64()
                ),
            ));
        }
        Ok(())
    }

    /// When a silence that began at `began` must end the stream, if it must.
    pub fn abort_at<T: std::ops::Add<Duration, Output = T>>(&self, began: T) -> Option<T> {
        (self.on_stall != OnStall::Wait).then(|| began + self.abort_after)
    }
}

/// A stream's longest silence past `stall_after`, on its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stall {
    /// The longest silence, in ms.
    pub longest_ms: u64,
    /// When it began, in ms from the exchange's start.
    pub began_ms: u64,
    /// Before the response head (the upstream had not answered yet).
    pub before_head: bool,
    /// promptgate ended the stream because of it (`stream.on_stall`).
    pub aborted: bool,
}

impl Stall {
    /// The longer of two.
    pub fn max(a: Option<Stall>, b: Option<Stall>) -> Option<Stall> {
        match (a, b) {
            (Some(a), Some(b)) => Some(if b.longest_ms > a.longest_ms || b.aborted {
                Stall {
                    aborted: a.aborted || b.aborted,
                    ..b
                }
            } else {
                Stall {
                    aborted: a.aborted || b.aborted,
                    ..a
                }
            }),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_check_their_values() {
        let mut s = StallSettings::default();
        s.apply(StreamLayer {
            stall_after: Some(Scalar::from("2s".to_owned())),
            on_stall: Some("error".into()),
            abort_after: Some(Scalar::from("5s".to_owned())),
        })
        .unwrap();
        assert_eq!(s.on_stall, OnStall::Error);
        assert_eq!(s.abort_at(Duration::ZERO), Some(Duration::from_secs(5)));
        let bad = |layer: StreamLayer| StallSettings::default().apply(layer).unwrap_err().0;
        assert_eq!(
            bad(StreamLayer {
                on_stall: Some("panic".into()),
                ..Default::default()
            }),
            "on-stall"
        );
        assert_eq!(
            bad(StreamLayer {
                abort_after: Some(Scalar::from("10s".to_owned())),
                on_stall: Some("reset".into()),
                ..Default::default()
            }),
            "abort-after"
        );
    }
}
