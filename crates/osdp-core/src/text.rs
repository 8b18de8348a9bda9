//! User-supplied names (model names, op ids) made safe where they leave the program: as a file
//! name, they must not climb out of the directory they are joined to.

/// Longest name [`file_component`] returns: well under the 255 bytes file systems allow, so a
/// long model name still gives a directory that can be created.
const MAX_COMPONENT_BYTES: usize = 100;

/// `name` as one plain path component: characters other than `[A-Za-z0-9._-]` become `_`, a
/// leading dot becomes `_` (no `..`, no hidden directory), empty becomes `model`. A model file
/// names itself, so `"../../x"` or `"/etc/cron.d/x"` must not pick where the dashboard writes.
pub fn file_component(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| match c {
            'A'..='Z' | 'a'..='z' | '0'..='9' | '.' | '_' | '-' => c,
            _ => '_',
        })
        .take(MAX_COMPONENT_BYTES)
        .collect();
    if out.starts_with('.') {
        out.replace_range(..1, "_");
    }
    if out.is_empty() {
        out.push_str("model");
    }
    out
}

/// `name` as it may be printed to a terminal: control characters (escape sequences that move
/// the cursor, retitle the window or clear the screen) and the bidirectional overrides that
/// reorder text are shown escaped, `\u{1b}`, rather than obeyed.
pub fn printable(name: &str) -> std::borrow::Cow<'_, str> {
    let hostile =
        |c: char| c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    if !name.chars().any(hostile) {
        return std::borrow::Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len() + 8);
    for c in name.chars() {
        if hostile(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Most characters of a text [`excerpt`] keeps.
pub const EXCERPT_CHARS: usize = 300;

/// `text` as a message may echo it: [`printable`], without trailing white space, and cut after
/// [`EXCERPT_CHARS`] characters with a note of how much was left out (`… (49.9 MiB more left
/// out)`): a failure message may be anything a worker or a file says, megabytes of it.
pub fn excerpt(text: &str) -> std::borrow::Cow<'_, str> {
    let text = text.trim_end();
    let cut = text
        .char_indices()
        .nth(EXCERPT_CHARS)
        .map_or(text.len(), |(i, _)| i);
    if cut == text.len() {
        return printable(text);
    }
    std::borrow::Cow::Owned(format!(
        "{}… ({} more left out)",
        printable(&text[..cut]),
        crate::units::bytes((text.len() - cut) as u64)
    ))
}

/// `a, b or c`: a list of names for a message.
pub fn or_list(names: &[&str]) -> String {
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => names.concat(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_component_never_leaves_its_directory() {
        assert_eq!(file_component("gpt2-xl"), "gpt2-xl");
        assert_eq!(file_component("llama_3.8b"), "llama_3.8b");
        assert_eq!(file_component("../../x"), "_._.._x");
        assert_eq!(file_component(".."), "_.");
        assert_eq!(file_component(".hidden"), "_hidden");
        assert_eq!(file_component("/etc/passwd"), "_etc_passwd");
        assert_eq!(file_component("a\\b"), "a_b");
        assert_eq!(file_component(""), "model");
        assert_eq!(file_component("\u{1b}[2J"), "__2J");
        assert_eq!(file_component("ü"), "_");
        assert_eq!(file_component(&"x".repeat(1000)).len(), MAX_COMPONENT_BYTES);
    }

    #[test]
    fn an_excerpt_keeps_a_short_text_and_cuts_a_long_one_saying_how_much_went() {
        assert_eq!(
            excerpt("CUDA error\nout of memory\n"),
            "CUDA error\\nout of memory"
        );
        let long = format!("{}\u{1b}{}", "é".repeat(EXCERPT_CHARS), "x".repeat(1 << 20));
        let left = crate::units::bytes(1 + (1 << 20));
        assert_eq!(
            excerpt(&long),
            format!("{}… ({left} more left out)", "é".repeat(EXCERPT_CHARS))
        );
    }

    #[test]
    fn printable_escapes_what_a_terminal_would_obey() {
        assert_eq!(printable("h0.attn.c_attn"), "h0.attn.c_attn");
        assert_eq!(printable("gpt2 ü 模型"), "gpt2 ü 模型");
        assert_eq!(printable("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(printable("x\ny\r\t"), "x\\ny\\r\\t");
        assert_eq!(printable("\u{9b}31m"), "\\u{9b}31m");
        assert_eq!(printable("abc\u{202e}def"), "abc\\u{202e}def");
    }
}
