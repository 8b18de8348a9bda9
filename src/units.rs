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

/// A duration for people: `850 µs`, `12.3 ms`, `1.24 s`, `3 min 20 s`.
pub fn seconds(s: f64) -> String {
    if !s.is_finite() {
        return "—".into();
    }
    if s < 1e-3 {
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

#[cfg(test)]
mod tests {
    use super::*;

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
