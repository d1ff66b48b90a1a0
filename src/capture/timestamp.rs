//! UTC timestamps as text (RFC 3339) and back, for records, `--since` and HAR.
//!
//! Civil-date arithmetic from Howard Hinnant's `days_from_civil`; no time zones.

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `2026-11-29T17:56:52.123Z` for milliseconds since the Unix epoch.
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// `2026-11-29 17:56:52` (UTC), for tables.
pub fn short(ms: u64) -> String {
    let text = rfc3339(ms);
    format!("{} {}", &text[..10], &text[11..19])
}

/// Milliseconds since the epoch for `YYYY-MM-DD`, `YYYY-MM-DDTHH:MM[:SS[.fff]][Z]`
/// (UTC), or a time before `now_ms`: `90s`, `30m`, `2h`, `7d`.
pub fn parse_since(text: &str, now_ms: u64) -> Result<u64, String> {
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
    let days = days_from_civil(y, m as u32, d as u32);
    if days < 0 {
        return Err(bad(t));
    }
    Ok((days as u64 * 86_400 + secs) * 1000 + frac_ms)
}

fn bad(text: &str) -> String {
    format!(
        "{text:?} is not a time (expected e.g. \"2h\", \"7d\", \"2026-11-29\" or \"2026-11-29T14:00Z\")"
    )
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
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
