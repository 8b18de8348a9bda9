//! The prompt at the bottom of the screen: the command line (`:`) and the search prompts (`/`
//! over the operators or the help). A line editor as a shell's: Left/Right, Home/End, Ctrl-U
//! (to the start), Ctrl-W (the word before the cursor), history on Up/Down, Tab completion.

use crossterm::event::{KeyCode, KeyModifiers};

/// What the prompt is for: what Enter does with it, and what its first character is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prompt {
    /// `:budget 40GiB`, … (Enter runs it).
    Command,
    /// `/attn`: the operators whose name or strategy contains it (the list follows as it is
    /// typed).
    FindOps,
    /// `/budget`: the help lines that mention it (the help follows as it is typed).
    FilterHelp,
}

impl Prompt {
    pub fn sigil(self) -> char {
        match self {
            Prompt::Command => ':',
            Prompt::FindOps | Prompt::FilterHelp => '/',
        }
    }
}

/// The longest line the prompt takes.
const MAX_CHARS: usize = 200;
/// Lines the command history keeps.
pub const HISTORY: usize = 100;

/// What a key did to the line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edit {
    /// The text changed (or the cursor moved): keep editing.
    Changed,
    /// Enter: the line is done.
    Submit,
    /// Esc, Ctrl-C, or Backspace on an empty line: close it unrun.
    Cancel,
    /// Tab: complete the word before the cursor.
    Complete,
    /// A key the line does not use.
    Ignored,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandLine {
    pub prompt: Prompt,
    chars: Vec<char>,
    /// Where the next character goes, in characters from the start.
    cursor: usize,
    /// While browsing the history: which entry (counted from the newest), and the line as it
    /// was before browsing began.
    browsing: Option<(usize, Vec<char>)>,
    /// What the last Tab offered when it could not choose (shown beside the line).
    pub hint: Option<String>,
}

impl CommandLine {
    pub fn new(prompt: Prompt) -> CommandLine {
        CommandLine {
            prompt,
            chars: Vec::new(),
            cursor: 0,
            browsing: None,
            hint: None,
        }
    }

    pub fn text(&self) -> String {
        self.chars.iter().collect()
    }

    /// The cursor's position, in characters from the start.
    pub fn cursor(&self) -> usize {
        self.cursor
    }

    /// Replace the whole line, the cursor at its end.
    pub fn set(&mut self, text: &str) {
        self.chars = text.chars().take(MAX_CHARS).collect();
        self.cursor = self.chars.len();
    }

    /// Apply one key; `history` is the commands run before, oldest first.
    pub fn key(&mut self, code: KeyCode, modifiers: KeyModifiers, history: &[String]) -> Edit {
        let ctrl = modifiers.contains(KeyModifiers::CONTROL);
        if code != KeyCode::Tab {
            self.hint = None;
        }
        match (code, ctrl) {
            (KeyCode::Esc, _) | (KeyCode::Char('c'), true) => Edit::Cancel,
            // Ctrl-J and Ctrl-M end a line as in readline; and a line typed before the
            // dashboard took the terminal arrives with its Enter as a newline (Ctrl-J).
            (KeyCode::Enter, _) | (KeyCode::Char('j' | 'm'), true) => Edit::Submit,
            (KeyCode::Tab, _) => Edit::Complete,
            (KeyCode::Char('u'), true) => {
                self.chars.drain(..self.cursor);
                self.cursor = 0;
                Edit::Changed
            }
            (KeyCode::Char('w'), true) => {
                let start = self.word_start();
                self.chars.drain(start..self.cursor);
                self.cursor = start;
                Edit::Changed
            }
            (KeyCode::Char('a'), true) | (KeyCode::Home, _) => self.move_to(0),
            (KeyCode::Char('e'), true) | (KeyCode::End, _) => self.move_to(self.chars.len()),
            (KeyCode::Left, _) => self.move_to(self.cursor.saturating_sub(1)),
            (KeyCode::Right, _) => self.move_to((self.cursor + 1).min(self.chars.len())),
            (KeyCode::Up, _) => self.browse(history, true),
            (KeyCode::Down, _) => self.browse(history, false),
            // Backspace on an empty line closes it (as in vim).
            (KeyCode::Backspace, _) if self.chars.is_empty() => Edit::Cancel,
            (KeyCode::Backspace, _) => {
                if self.cursor > 0 {
                    self.cursor -= 1;
                    self.chars.remove(self.cursor);
                }
                Edit::Changed
            }
            (KeyCode::Delete, _) => {
                if self.cursor < self.chars.len() {
                    self.chars.remove(self.cursor);
                }
                Edit::Changed
            }
            (KeyCode::Char(c), false) if !c.is_control() && self.chars.len() < MAX_CHARS => {
                self.chars.insert(self.cursor, c);
                self.cursor += 1;
                Edit::Changed
            }
            _ => Edit::Ignored,
        }
    }

    fn move_to(&mut self, at: usize) -> Edit {
        self.cursor = at;
        Edit::Changed
    }

    /// Where the word before the cursor starts (Ctrl-W deletes back to it, with the spaces
    /// after it).
    fn word_start(&self) -> usize {
        let mut i = self.cursor;
        while i > 0 && self.chars[i - 1].is_whitespace() {
            i -= 1;
        }
        while i > 0 && !self.chars[i - 1].is_whitespace() {
            i -= 1;
        }
        i
    }

    /// Up (`older`) or Down through the history; past the newest, the line as it was typed.
    fn browse(&mut self, history: &[String], older: bool) -> Edit {
        let at = self.browsing.as_ref().map(|(k, _)| *k);
        let next = match (at, older) {
            (None, true) if !history.is_empty() => Some(0),
            (None, _) => return Edit::Ignored,
            (Some(k), true) => Some((k + 1).min(history.len() - 1)),
            (Some(0), false) => None,
            (Some(k), false) => Some(k - 1),
        };
        match next {
            Some(k) => {
                if self.browsing.is_none() {
                    self.browsing = Some((k, self.chars.clone()));
                }
                if let Some(b) = self.browsing.as_mut() {
                    b.0 = k;
                }
                self.set(&history[history.len() - 1 - k]);
            }
            None => {
                let typed = self.browsing.take().map(|(_, t)| t).unwrap_or_default();
                self.chars = typed;
                self.cursor = self.chars.len();
            }
        }
        Edit::Changed
    }

    /// The word the cursor ends (what Tab completes): its index among the line's words and
    /// the words before it.
    pub fn word_at_cursor(&self) -> (Vec<String>, String) {
        let before: String = self.chars[..self.cursor].iter().collect();
        let mut words: Vec<String> = before.split_whitespace().map(str::to_owned).collect();
        let current = if before.ends_with(char::is_whitespace) || before.is_empty() {
            String::new()
        } else {
            words.pop().unwrap_or_default()
        };
        (words, current)
    }

    /// Complete the word before the cursor from `candidates`: one match is put in whole with a
    /// space after it; several, as far as they agree, and (when that adds nothing) listed in
    /// the hint; none, said in the hint.
    pub fn complete(&mut self, candidates: &[String]) {
        let (_, current) = self.word_at_cursor();
        let matches: Vec<&String> = candidates
            .iter()
            .filter(|c| c.starts_with(&current))
            .collect();
        let common = match matches.as_slice() {
            [] => {
                self.hint = Some(format!("nothing to complete for {current:?}"));
                return;
            }
            [one] => format!("{one} "),
            many => common_prefix(many),
        };
        let added: Vec<char> = common.chars().skip(current.chars().count()).collect();
        if added.is_empty() {
            const SHOWN: usize = 12;
            let mut hint: Vec<&str> = matches.iter().take(SHOWN).map(|s| s.as_str()).collect();
            let more = matches.len().saturating_sub(SHOWN);
            let more = format!("… {more} more");
            if matches.len() > SHOWN {
                hint.push(&more);
            }
            self.hint = Some(hint.join("  "));
            return;
        }
        for c in added {
            if self.chars.len() >= MAX_CHARS {
                break;
            }
            self.chars.insert(self.cursor, c);
            self.cursor += 1;
        }
    }
}

fn common_prefix(words: &[&String]) -> String {
    let first = words[0];
    let mut len = first.len();
    for w in &words[1..] {
        len = first
            .char_indices()
            .zip(w.chars())
            .take_while(|((_, a), b)| a == b)
            .last()
            .map_or(0, |((i, a), _)| i + a.len_utf8())
            .min(len);
    }
    first[..len].to_owned()
}

/// A typed line split into words as a shell would: whitespace separates them, except inside
/// '…' or "…" quotes or after a backslash. An unclosed quote is an error.
pub fn split_words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quote: Option<char> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.get_or_insert_with(String::new).push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                word.get_or_insert_with(String::new);
            }
            (None, '\\') => {
                let next = chars.next().unwrap_or('\\');
                word.get_or_insert_with(String::new).push(next);
            }
            (None, c) if c.is_whitespace() => words.extend(word.take()),
            (None, c) => word.get_or_insert_with(String::new).push(c),
        }
    }
    if let Some(q) = quote {
        return Err(format!("a {q} quote is not closed"));
    }
    words.extend(word);
    Ok(words)
}

/// `~` and `~/…` in a typed path are the home directory (`$HOME`).
pub fn expand_home(path: &str) -> std::path::PathBuf {
    let home = std::env::var_os("HOME").filter(|h| !h.is_empty());
    match (path.strip_prefix('~'), home) {
        (Some(""), Some(home)) => std::path::PathBuf::from(home),
        (Some(rest), Some(home)) if rest.starts_with('/') => {
            std::path::PathBuf::from(home).join(&rest[1..])
        }
        _ => std::path::PathBuf::from(path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn typed(line: &mut CommandLine, s: &str) {
        for c in s.chars() {
            line.key(KeyCode::Char(c), KeyModifiers::NONE, &[]);
        }
    }

    fn ctrl(line: &mut CommandLine, c: char) -> Edit {
        line.key(KeyCode::Char(c), KeyModifiers::CONTROL, &[])
    }

    #[test]
    fn editing_keys_move_and_delete_as_in_a_shell() {
        let mut l = CommandLine::new(Prompt::Command);
        typed(&mut l, "budget 12GiB");
        l.key(KeyCode::Left, KeyModifiers::NONE, &[]);
        l.key(KeyCode::Left, KeyModifiers::NONE, &[]);
        l.key(KeyCode::Left, KeyModifiers::NONE, &[]);
        typed(&mut l, "0");
        assert_eq!(l.text(), "budget 120GiB");
        l.key(KeyCode::Home, KeyModifiers::NONE, &[]);
        typed(&mut l, "x");
        assert_eq!(l.text(), "xbudget 120GiB");
        l.key(KeyCode::Left, KeyModifiers::NONE, &[]);
        l.key(KeyCode::Delete, KeyModifiers::NONE, &[]);
        l.key(KeyCode::End, KeyModifiers::NONE, &[]);
        l.key(KeyCode::Backspace, KeyModifiers::NONE, &[]);
        assert_eq!(l.text(), "budget 120Gi");
        ctrl(&mut l, 'w');
        assert_eq!(l.text(), "budget ");
        ctrl(&mut l, 'w');
        assert_eq!(l.text(), "");
        typed(&mut l, "gpu 3 budget");
        for _ in 0..7 {
            l.key(KeyCode::Left, KeyModifiers::NONE, &[]);
        }
        ctrl(&mut l, 'u');
        assert_eq!((l.text().as_str(), l.cursor()), (" budget", 0));
        assert_eq!(ctrl(&mut l, 'c'), Edit::Cancel);
    }

    #[test]
    fn up_and_down_walk_the_history_and_come_back_to_the_typed_line() {
        let history = vec!["budget 20".to_string(), "split 2".to_string()];
        let mut l = CommandLine::new(Prompt::Command);
        typed(&mut l, "mi");
        l.key(KeyCode::Up, KeyModifiers::NONE, &history);
        assert_eq!(l.text(), "split 2");
        l.key(KeyCode::Up, KeyModifiers::NONE, &history);
        l.key(KeyCode::Up, KeyModifiers::NONE, &history);
        assert_eq!(l.text(), "budget 20", "the oldest stays");
        l.key(KeyCode::Down, KeyModifiers::NONE, &history);
        assert_eq!(l.text(), "split 2");
        l.key(KeyCode::Down, KeyModifiers::NONE, &history);
        assert_eq!(l.text(), "mi");
    }

    #[test]
    fn tab_completes_one_match_whole_and_lists_several() {
        let words: Vec<String> = ["budget", "batch", "micro"].map(String::from).to_vec();
        let mut l = CommandLine::new(Prompt::Command);
        typed(&mut l, "mi");
        l.complete(&words);
        assert_eq!(l.text(), "micro ");
        let mut l = CommandLine::new(Prompt::Command);
        typed(&mut l, "b");
        l.complete(&words);
        assert_eq!(l.text(), "b");
        assert_eq!(l.hint.as_deref(), Some("budget  batch"));
        typed(&mut l, "u");
        assert_eq!(l.hint, None);
        l.complete(&words);
        assert_eq!(l.text(), "budget ");
    }

    #[test]
    fn words_split_as_a_shell_splits_them() {
        assert_eq!(
            split_words(r#"w "my plans/a b.json""#).unwrap(),
            ["w", "my plans/a b.json"]
        );
        assert_eq!(split_words(r"w a\ b 'c d'").unwrap(), ["w", "a b", "c d"]);
        assert_eq!(split_words("w ''").unwrap(), ["w", ""]);
        assert!(split_words("w 'open").is_err());
    }
}
