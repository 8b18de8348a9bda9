//! Formatting of counts, byte sizes and rates for people.

use bytesize::ByteSize;

/// `124439808` → `124,439,808`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Binary-prefixed size: `1.2 GiB`.
pub fn bytes(n: u64) -> String {
    ByteSize::b(n).display().iec().to_string()
}

/// A figure with `decimals` places from 1 up, and two significant digits below it, so that a
/// slow rate still reads: `96.5`, `0.25`, `0.0038` (where `{:.1}` printed `0.0`).
pub fn figure(x: f64, decimals: usize) -> String {
    if !x.is_finite() {
        return "—".into();
    }
    if x.abs() >= 1.0 || x == 0.0 {
        return format!("{x:.decimals$}");
    }
    let places = (-x.abs().log10()).ceil() as usize + 1;
    format!("{x:.0$}", places.max(decimals))
}

/// A count and its noun, plural but for one: `1 rank`, `8 ranks`.
pub fn counted(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Short count with an SI suffix: `124.4 M`, `6.74 B`.
pub fn count(n: u64) -> String {
    let x = n as f64;
    let (v, suffix) = if x >= 1e12 {
        (x / 1e12, "T")
    } else if x >= 1e9 {
        (x / 1e9, "B")
    } else if x >= 1e6 {
        (x / 1e6, "M")
    } else if x >= 1e3 {
        (x / 1e3, "k")
    } else {
        return n.to_string();
    };
    let digits = if v >= 100.0 { 1 } else { 2 };
    format!("{v:.digits$} {suffix}")
}

/// A duration for people: `850 µs`, `12.3 ms`, `1.24 s`, `3 min 20 s`; none at all, `0 s`.
pub fn seconds(s: f64) -> String {
    if !s.is_finite() {
        return "—".into();
    }
    if s == 0.0 {
        "0 s".into()
    } else if s < 1e-3 {
        format!("{:.0} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else if s < 120.0 {
        format!("{s:.2} s")
    } else {
        format!("{} min {:.0} s", (s / 60.0) as u64, s % 60.0)
    }
}

/// FLOPs with an SI prefix: `2.91 GFLOP`.
pub fn flops(x: f64) -> String {
    let (v, prefix) = if x >= 1e15 {
        (x / 1e15, "P")
    } else if x >= 1e12 {
        (x / 1e12, "T")
    } else if x >= 1e9 {
        (x / 1e9, "G")
    } else if x >= 1e6 {
        (x / 1e6, "M")
    } else if x >= 1e3 {
        (x / 1e3, "k")
    } else {
        (x, "")
    };
    format!("{v:.2} {prefix}FLOP")
}

/// Seconds since the Unix epoch as a UTC calendar date and time: `(year, month, day, hour,
/// minute, second)` in the proleptic Gregorian calendar (Howard Hinnant's `civil_from_days`).
pub fn utc_fields(secs: u64) -> (i64, i64, i64, u64, u64, u64) {
    let (days, day_secs) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (
        year,
        month,
        day,
        day_secs / 3_600,
        day_secs % 3_600 / 60,
        day_secs % 60,
    )
}

/// `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc(secs: u64) -> String {
    let (y, mo, d, h, mi, s) = utc_fields(secs);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02} UTC")
}

/// A [`utc`] text read back as seconds since the Unix epoch (Hinnant's `days_from_civil`);
/// `None` for any other text.
pub fn parse_utc(text: &str) -> Option<u64> {
    let rest = text.strip_suffix(" UTC")?;
    let (date, time) = rest.split_once(' ')?;
    let num = |s: &str| s.parse::<i64>().ok();
    let d: Vec<i64> = date.split('-').map(num).collect::<Option<_>>()?;
    let t: Vec<i64> = time.split(':').map(num).collect::<Option<_>>()?;
    let ([y, mo, day], [h, mi, sec]) = (d.as_slice(), t.as_slice()) else {
        return None;
    };
    let in_range = (1..=12).contains(mo)
        && (1..=31).contains(day)
        && (0..24).contains(h)
        && (0..60).contains(mi)
        && (0..61).contains(sec);
    if !in_range {
        return None;
    }
    let y = if *mo <= 2 { y - 1 } else { *y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + h * 3_600 + mi * 60 + sec).ok()
}

/// A span of wall-clock time for people: `45 s`, `3 min 12 s`, `2 h 05 min`.
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "—".into();
    }
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s} s"),
        60..3_600 => format!("{} min {:02} s", s / 60, s % 60),
        _ => format!("{} h {:02} min", s / 3_600, s % 3_600 / 60),
    }
}

/// RFC 3339 to the second: `YYYY-MM-DDTHH:MM:SSZ`.
pub fn rfc3339(secs: u64) -> String {
    let (y, mo, d, h, mi, s) = utc_fields(secs);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_rates_keep_two_significant_digits() {
        assert_eq!(figure(96.53, 1), "96.5");
        assert_eq!(figure(2.6, 1), "2.6");
        assert_eq!(figure(0.0, 1), "0.0");
        assert_eq!(figure(0.25, 1), "0.25");
        assert_eq!(figure(0.003766, 1), "0.0038");
        assert_eq!(figure(0.003766, 2), "0.0038");
        assert_eq!(figure(0.5, 2), "0.50");
        assert_eq!(figure(f64::NAN, 1), "—");
    }

    #[test]
    fn durations_read_in_their_unit_and_none_reads_zero_seconds() {
        assert_eq!(seconds(0.0), "0 s");
        assert_eq!(seconds(767e-6), "767 µs");
        assert_eq!(seconds(0.0123), "12.3 ms");
        assert_eq!(seconds(3.48), "3.48 s");
        assert_eq!(seconds(531.05), "8 min 51 s");
    }

    #[test]
    fn dates_are_printed_in_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_709_251_199), "2024-02-29 23:59:59 UTC");
        assert_eq!(rfc3339(1_735_689_600 + 3_723), "2025-01-01T01:02:03Z");
    }

    #[test]
    fn utc_texts_read_back_to_the_second() {
        for secs in [
            0,
            951_782_400,
            1_709_251_199,
            1_735_689_600 + 3_723,
            4_102_444_800,
        ] {
            assert_eq!(parse_utc(&utc(secs)), Some(secs), "{}", utc(secs));
        }
        for bad in [
            "at an unknown time",
            "2024-02-29 23:59:59",
            "2024-13-01 00:00:00 UTC",
            "",
        ] {
            assert_eq!(parse_utc(bad), None, "{bad}");
        }
    }

    #[test]
    fn durations_read_as_people_say_them() {
        assert_eq!(duration(0.4), "0 s");
        assert_eq!(duration(45.0), "45 s");
        assert_eq!(duration(192.0), "3 min 12 s");
        assert_eq!(duration(7_500.0), "2 h 05 min");
        assert_eq!(duration(f64::NAN), "—");
    }

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(124_439_808), "124,439,808");
    }

    #[test]
    fn count_and_flops_pick_a_prefix() {
        assert_eq!(count(124_439_808), "124.4 M");
        assert_eq!(count(6_738_415_616), "6.74 B");
        assert_eq!(count(512), "512");
        assert_eq!(flops(2.5e9), "2.50 GFLOP");
    }

    #[test]
    fn bytes_are_binary() {
        assert_eq!(bytes(1 << 30), "1.0 GiB");
    }
}
