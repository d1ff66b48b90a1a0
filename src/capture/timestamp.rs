//! UTC timestamps as text (RFC 3339) and back, for records, `--since` and HAR.
//!
//! The calendar is the `time` crate's; no time zones.

/// Milliseconds since the Unix epoch, now.
pub(crate) fn now_ms() -> u64 {
    ms_of(std::time::SystemTime::now())
}

/// Milliseconds since the Unix epoch at `t` (0 before it).
pub(crate) fn ms_of(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `2026-11-29T17:56:52.123Z` for milliseconds since the Unix epoch.
pub(crate) fn rfc3339(ms: u64) -> String {
    let secs = i64::try_from(ms / 1000).unwrap_or(i64::MAX);
    let at =
        time::OffsetDateTime::from_unix_timestamp(secs).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        ms % 1000
    )
}

/// `2026-11-29 17:56:52` (UTC), for tables.
pub(crate) fn short(ms: u64) -> String {
    let text = rfc3339(ms);
    format!("{} {}", &text[..10], &text[11..19])
}

/// Milliseconds since the epoch for `YYYY-MM-DD`, `YYYY-MM-DDTHH:MM[:SS[.fff]][Z]`
/// (UTC), or a time before `now_ms`: `90s`, `30m`, `2h`, `7d`.
pub(crate) fn parse_since(text: &str, now_ms: u64) -> Result<u64, NotATime> {
    let t = text.trim();
    let unit_at = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if unit_at > 0 && unit_at < t.len() && !t[unit_at..].contains('-') {
        let n: u64 = t[..unit_at].parse().map_err(|_| bad(t))?;
        let factor = match &t[unit_at..] {
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(bad(t)),
        };
        return Ok(now_ms.saturating_sub(n.saturating_mul(factor)));
    }
    let (date, time) = t.split_once(['T', ' ']).unwrap_or((t, ""));
    let mut parts = date.split('-').map(|p| p.parse::<i64>());
    let (Some(Ok(y)), Some(Ok(m)), Some(Ok(d)), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad(t));
    };
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return Err(bad(t));
    }
    let time = time.trim_end_matches('Z');
    let mut secs = 0u64;
    let mut frac_ms = 0u64;
    if !time.is_empty() {
        let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
        let fields: Vec<&str> = hms.split(':').collect();
        if !(2..=3).contains(&fields.len()) {
            return Err(bad(t));
        }
        let mut mult = 3600;
        for f in fields {
            let v: u64 = f.parse().map_err(|_| bad(t))?;
            secs += v * mult;
            mult /= 60;
        }
        if !frac.is_empty() {
            let digits: String = frac.chars().take(3).collect();
            frac_ms = format!("{digits:0<3}").parse().map_err(|_| bad(t))?;
        }
    }
    let month = u8::try_from(m)
        .ok()
        .and_then(|m| time::Month::try_from(m).ok())
        .ok_or_else(|| bad(t))?;
    let year = i32::try_from(y).map_err(|_| bad(t))?;
    let day = u8::try_from(d).map_err(|_| bad(t))?;
    let date = time::Date::from_calendar_date(year, month, day).map_err(|_| bad(t))?;
    let midnight = date.midnight().assume_utc().unix_timestamp();
    let days_secs = u64::try_from(midnight).map_err(|_| bad(t))?;
    Ok((days_secs + secs) * 1000 + frac_ms)
}

/// A `--since`/`--until` value that names no time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a time (expected e.g. \"2h\", \"7d\", \"2026-11-29\" or \"2026-11-29T14:00Z\")"
)]
pub(crate) struct NotATime(String);

fn bad(text: &str) -> NotATime {
    NotATime(text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_parses() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_795_975_012_345), "2026-11-29T17:56:52.345Z");
        assert_eq!(short(1_795_975_012_345), "2026-11-29 17:56:52");
        for ms in [0, 951_782_400_000, 1_795_975_012_345, 4_102_444_800_000] {
            assert_eq!(parse_since(&rfc3339(ms), 0), Ok(ms));
        }
        assert_eq!(parse_since("2026-11-30", 0), Ok(1_795_996_800_000));
        assert_eq!(parse_since("2026-11-30T14:36Z", 0), Ok(1_796_049_360_000));
        assert_eq!(parse_since("2h", 10_000_000), Ok(10_000_000 - 7_200_000));
        assert_eq!(parse_since("7d", 0), Ok(0));
        assert!(parse_since("yesterday", 0).is_err());
        assert!(parse_since("2026-13-01", 0).is_err());
        assert!(parse_since("5w", 0).is_err());
    }
}
