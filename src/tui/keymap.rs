//! Every key the dashboard answers, in one table: key dispatch ([`action_for`]), the footer's
//! reminder ([`footer`]) and the help overlay ([`help_lines`]) all read it, so a key cannot be
//! bound in one place and documented in another.

use crossterm::event::{KeyCode, KeyModifiers};

use super::app::{Action, View};

/// One key: a code, with Ctrl held or not. Other modifiers are ignored (Shift arrives as the
/// upper-case character).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub code: KeyCode,
    pub ctrl: bool,
}

const fn ch(c: char) -> Key {
    Key {
        code: KeyCode::Char(c),
        ctrl: false,
    }
}

const fn code(code: KeyCode) -> Key {
    Key { code, ctrl: false }
}

const fn ctrl(c: char) -> Key {
    Key {
        code: KeyCode::Char(c),
        ctrl: true,
    }
}

/// Which panel's footer names an entry: every footer, or only while that panel has the keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Any,
    Ops,
    Gpus,
}

/// One line of help: the keys as the user reads them, what they do, the footer's reminder
/// (its keys, its word, and the panel it belongs to, if it is worth a place there), the log
/// view's footer (its keys and word, if the entry means something there), and the bindings.
pub struct Entry {
    pub keys: &'static str,
    pub help: &'static str,
    pub footer: Option<(&'static str, &'static str, Scope)>,
    pub log_footer: Option<(&'static str, &'static str)>,
    pub bindings: &'static [(Key, Action)],
}

pub const KEYMAP: &[Entry] = &[
    Entry {
        keys: "↑ ↓ k j PgUp PgDn",
        help: "move; in the log, the help or the comparison, scroll (the mouse wheel scrolls \
               too)",
        footer: Some(("↑↓", "move", Scope::Any)),
        log_footer: Some(("↑↓ PgUp/PgDn", "scroll")),
        bindings: &[
            (code(KeyCode::Up), Action::Up),
            (ch('k'), Action::Up),
            (code(KeyCode::Down), Action::Down),
            (ch('j'), Action::Down),
            (code(KeyCode::PageUp), Action::PageUp),
            (code(KeyCode::PageDown), Action::PageDown),
        ],
    },
    Entry {
        keys: "Home End",
        help: "first / last row; the log's top / its tail, which the log then follows",
        footer: None,
        log_footer: Some(("Home/End", "top/tail")),
        bindings: &[
            (code(KeyCode::Home), Action::Home),
            (code(KeyCode::End), Action::End),
        ],
    },
    Entry {
        keys: "Enter Space",
        help: "expand / collapse a block, or open an operator's choices, priced (again: close)",
        footer: Some(("Enter", "open", Scope::Ops)),
        log_footer: None,
        bindings: &[
            (code(KeyCode::Enter), Action::Toggle),
            (ch(' '), Action::Toggle),
        ],
    },
    Entry {
        keys: "/",
        help: "find operators by name or strategy (Esc: all again); in help, filter it",
        footer: Some(("/", "find", Scope::Ops)),
        log_footer: None,
        bindings: &[(ch('/'), Action::Find)],
    },
    Entry {
        keys: "n / N",
        help: "the next / previous operator the last / found",
        footer: Some(("n/N", "next", Scope::Ops)),
        log_footer: None,
        bindings: &[(ch('n'), Action::NextMatch), (ch('N'), Action::PrevMatch)],
    },
    Entry {
        keys: "p",
        help: "pin the selected op to the next strategy, in the legend's order, then unpinned",
        footer: Some(("p", "pin", Scope::Ops)),
        log_footer: None,
        bindings: &[(ch('p'), Action::CyclePin)],
    },
    Entry {
        keys: "R",
        help: "recompute the selected block, or not, against the plan's choice (R again: the \
               planner decides)",
        footer: Some(("R", "recompute", Scope::Ops)),
        log_footer: None,
        bindings: &[(ch('R'), Action::ToggleRecompute)],
    },
    Entry {
        keys: "Tab",
        help: "move focus between operators and GPUs",
        footer: Some(("Tab", "focus", Scope::Any)),
        log_footer: None,
        bindings: &[(code(KeyCode::Tab), Action::FocusNext)],
    },
    Entry {
        keys: "+ / -",
        help: "budget up / down (1 GiB steps; 16 MiB under 1 GiB); the selected GPU's when \
               the GPU panel has focus",
        footer: Some(("+/-", "budget", Scope::Any)),
        log_footer: None,
        bindings: &[
            (ch('+'), Action::RaiseBudget),
            (ch('='), Action::RaiseBudget),
            (ch('-'), Action::LowerBudget),
            (ch('_'), Action::LowerBudget),
        ],
    },
    Entry {
        keys: "] / [",
        help: "raise / lower the operator split limit",
        footer: Some(("]/[", "split", Scope::Any)),
        log_footer: None,
        bindings: &[(ch(']'), Action::SplitUp), (ch('['), Action::SplitDown)],
    },
    Entry {
        keys: "b / B",
        help: "micro-batch: auto, then 1, 2, 4, … fixed / global batch: any (no \
               accumulation, the fastest micro-batch that fits), then GPUs × 1, 2, 4, …",
        footer: Some(("b/B", "batch", Scope::Any)),
        log_footer: None,
        bindings: &[
            (ch('b'), Action::CycleBatch),
            (ch('B'), Action::CycleGlobalBatch),
        ],
    },
    Entry {
        keys: "g",
        help: "show the selected block's graph / the frontier chart",
        footer: Some(("g", "graph", Scope::Ops)),
        log_footer: None,
        bindings: &[(ch('g'), Action::ToggleGraph)],
    },
    Entry {
        keys: "1-4 v",
        help: "views: 1 plan (operators, GPUs, chart), 2 graph and frontier, 3 GPUs, 4 \
               training; v the next",
        footer: Some(("1-4", "views", Scope::Any)),
        log_footer: None,
        bindings: &[
            (ch('1'), Action::ShowView(View::Plan)),
            (ch('2'), Action::ShowView(View::Graph)),
            (ch('3'), Action::ShowView(View::Gpus)),
            (ch('4'), Action::ShowView(View::Training)),
            (ch('v'), Action::NextView),
        ],
    },
    Entry {
        keys: ":",
        help: "command line: budget SIZE (20 = 20 GiB), gpu N budget SIZE, batch N|any, micro \
               N|auto, split K, steps N (of runs s starts), target osdp|fsdp2, op NAME, write|export [PATH] (~, \"quoted paths\"), q; Tab completes, \
               ↑↓ history, Esc closes",
        footer: Some((":", "cmd", Scope::Any)),
        log_footer: None,
        bindings: &[(ch(':'), Action::OpenCommand)],
    },
    Entry {
        keys: "u",
        help: "undo the last change of budget, split, batch, pins or recomputation",
        footer: Some(("u", "undo", Scope::Any)),
        log_footer: None,
        bindings: &[(ch('u'), Action::Undo)],
    },
    Entry {
        keys: "w e",
        help: "write the plan to MODEL.plan.json; e: for FSDP2, MODEL.fsdp2.json (:write/:export \
               PATH)",
        footer: Some(("w", "write", Scope::Any)),
        log_footer: None,
        bindings: &[(ch('w'), Action::WritePlan), (ch('e'), Action::ExportPlan)],
    },
    Entry {
        keys: "c",
        help: "compare the plan on screen with the running one (c again: close)",
        footer: Some(("c", "compare", Scope::Any)),
        log_footer: None,
        bindings: &[(ch('c'), Action::Compare)],
    },
    Entry {
        keys: "s",
        help: "start training with the plan on screen",
        footer: Some(("s", "start", Scope::Any)),
        log_footer: None,
        bindings: &[(ch('s'), Action::StartRun)],
    },
    Entry {
        keys: "x",
        help: "stop the run (checkpoint first); x again: kill it",
        footer: Some(("x", "stop", Scope::Any)),
        log_footer: Some(("x", "stop")),
        bindings: &[(ch('x'), Action::StopRun)],
    },
    Entry {
        keys: "r",
        help: "restart the run from its checkpoint under the plan on screen",
        footer: Some(("r", "restart", Scope::Any)),
        log_footer: None,
        bindings: &[(ch('r'), Action::RestartRun)],
    },
    Entry {
        keys: "l",
        help: "the worker's log (its output and errors), following the tail; l again: close",
        footer: Some(("l", "log", Scope::Any)),
        log_footer: None,
        bindings: &[(ch('l'), Action::ToggleLog)],
    },
    Entry {
        keys: "y",
        help: "yes to the question in the footer (any other key: no)",
        footer: None,
        log_footer: None,
        bindings: &[(ch('y'), Action::Yes)],
    },
    Entry {
        keys: "d",
        help: "when quitting with a run going: detach (the run keeps going; a later dashboard \
               attaches to it)",
        footer: None,
        log_footer: None,
        bindings: &[(ch('d'), Action::Detach)],
    },
    Entry {
        keys: "?",
        help: "this help: ↑↓ j k PgUp PgDn scroll it, / filters it",
        footer: Some(("?", "help", Scope::Any)),
        log_footer: Some(("?", "help")),
        bindings: &[(ch('?'), Action::ToggleHelp)],
    },
    Entry {
        keys: "Esc",
        help: "close what is on top: help, a question, an operator's choices, the comparison, \
               the log, a filter, the command line (never quits)",
        footer: None,
        log_footer: None,
        bindings: &[(code(KeyCode::Esc), Action::Back)],
    },
    Entry {
        keys: "q Ctrl-C :q",
        help: "quit (asks first while a run is going); close the log, help or an operator's \
               choices",
        footer: Some(("q", "quit", Scope::Any)),
        log_footer: Some(("q/Esc", "close the log")),
        bindings: &[(ch('q'), Action::Quit), (ctrl('c'), Action::Quit)],
    },
];

/// The action a key asks for, if any.
pub fn action_for(code: KeyCode, modifiers: KeyModifiers) -> Option<Action> {
    let ctrl_held = modifiers.contains(KeyModifiers::CONTROL);
    let find = |ctrl: bool| {
        KEYMAP
            .iter()
            .flat_map(|e| e.bindings)
            .find(|(k, _)| k.code == code && k.ctrl == ctrl)
            .map(|&(_, a)| a)
    };
    // Ctrl with a letter is its own key (Ctrl-C quits, `c` compares); Ctrl with an arrow or
    // Enter is the key itself.
    find(ctrl_held).or_else(|| {
        (ctrl_held && !matches!(code, KeyCode::Char(_)))
            .then(|| find(false))
            .flatten()
    })
}

/// The footer's reminder for the panel with the keys (`focus`): `↑↓ move  Enter open  / find
/// …  ? help  q quit`, as much of it as fits `width` columns: entries in table order, help and
/// quit always.
pub fn footer(width: usize, focus: Scope) -> String {
    let items: Vec<String> = KEYMAP
        .iter()
        .filter_map(|e| e.footer)
        .filter(|&(_, _, scope)| scope == Scope::Any || scope == focus)
        .map(|(keys, word, _)| format!(" {keys} {word} "))
        .collect();
    fit(&items, width)
}

/// The footer while the log is open: `↑↓ PgUp/PgDn scroll  Home/End top/tail  …  q/Esc close
/// the log`, as much as fits.
pub fn log_footer(width: usize) -> String {
    let items: Vec<String> = KEYMAP
        .iter()
        .filter_map(|e| e.log_footer)
        .map(|(keys, word)| format!(" {keys} {word} "))
        .collect();
    fit(&items, width)
}

/// `items` in order as far as `width` allows, and the last two always.
fn fit(items: &[String], width: usize) -> String {
    let (main, always) = items.split_at(items.len().saturating_sub(2));
    let mut used: usize = always.iter().map(|i| i.chars().count()).sum();
    let mut out = String::new();
    for item in main {
        let n = item.chars().count();
        if used + n > width {
            break;
        }
        used += n;
        out.push_str(item);
    }
    out.extend(always.iter().map(String::as_str));
    out.trim_end().to_owned()
}

/// Whether `text` mentions `filter` (case aside; an empty filter is in everything).
pub fn mentions(text: &str, filter: &str) -> bool {
    text.to_lowercase().contains(&filter.trim().to_lowercase())
}

/// The help overlay's lines: keys in a column, then what they do, wrapped to `width`; only the
/// entries that mention `filter` (in their keys or their words).
pub fn help_lines(width: usize, filter: &str) -> Vec<String> {
    let col = KEYMAP
        .iter()
        .map(|e| e.keys.chars().count())
        .max()
        .unwrap_or(0)
        + 2;
    let text_width = width.saturating_sub(col).max(20);
    let mut out = Vec::new();
    for e in KEYMAP
        .iter()
        .filter(|e| mentions(e.keys, filter) || mentions(e.help, filter))
    {
        let mut line = format!("{:<col$}", e.keys);
        let mut used = 0;
        for word in e.help.split_whitespace() {
            let n = word.chars().count();
            if used > 0 && used + 1 + n > text_width {
                out.push(line);
                line = " ".repeat(col);
                used = 0;
            }
            if used > 0 {
                line.push(' ');
                used += 1;
            }
            line.push_str(word);
            used += n;
        }
        out.push(line);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_key_is_bound_twice() {
        let all: Vec<Key> = KEYMAP
            .iter()
            .flat_map(|e| e.bindings.iter().map(|(k, _)| *k))
            .collect();
        for (i, k) in all.iter().enumerate() {
            assert!(!all[i + 1..].contains(k), "{k:?} is bound twice");
        }
    }

    #[test]
    fn keys_answer_as_the_table_says() {
        assert_eq!(
            action_for(KeyCode::Char('c'), KeyModifiers::CONTROL),
            Some(Action::Quit)
        );
        // Plain `c` compares; Ctrl-C quits.
        assert_eq!(
            action_for(KeyCode::Char('c'), KeyModifiers::NONE),
            Some(Action::Compare)
        );
        assert_eq!(
            action_for(KeyCode::Char('B'), KeyModifiers::SHIFT),
            Some(Action::CycleGlobalBatch)
        );
        assert_eq!(action_for(KeyCode::Char('z'), KeyModifiers::NONE), None);
        for e in KEYMAP {
            for &(k, a) in e.bindings {
                let m = if k.ctrl {
                    KeyModifiers::CONTROL
                } else {
                    KeyModifiers::NONE
                };
                assert_eq!(action_for(k.code, m), Some(a), "{}", e.keys);
            }
        }
    }

    #[test]
    fn the_footer_names_the_focused_panels_keys_and_fits_the_terminal() {
        let wide = footer(300, Scope::Ops);
        for want in [
            "↑↓ move",
            "Enter open",
            "/ find",
            "p pin",
            "+/- budget",
            "s start",
            "x stop",
            "? help",
            "q quit",
        ] {
            assert!(wide.contains(want), "{wide}");
        }
        let gpus = footer(300, Scope::Gpus);
        assert!(
            !gpus.contains("p pin") && !gpus.contains("/ find"),
            "{gpus}"
        );
        assert!(gpus.contains("+/- budget"), "{gpus}");
        for width in [80, 60, 30] {
            for scope in [Scope::Ops, Scope::Gpus] {
                let f = footer(width, scope);
                assert!(f.chars().count() <= width, "{f}");
                assert!(f.ends_with("? help  q quit"), "{f}");
            }
        }
        // At 80 columns the operators' own keys come first.
        let f = footer(80, Scope::Ops);
        for want in ["Enter open", "/ find", "n/N next", "p pin", "R recompute"] {
            assert!(f.contains(want), "{f}");
        }
        // Every key a footer names is bound.
        for e in KEYMAP {
            if let Some((keys, _, _)) = e.footer {
                assert!(!e.bindings.is_empty(), "{keys}");
            }
        }
    }

    #[test]
    fn the_log_views_footer_names_its_keys_and_fits() {
        let f = log_footer(80);
        for want in [
            "↑↓ PgUp/PgDn scroll",
            "Home/End top/tail",
            "q/Esc close the log",
        ] {
            assert!(f.contains(want), "{f}");
        }
        assert!(f.chars().count() <= 80, "{f}");
        assert_eq!(
            action_for(KeyCode::Char('l'), KeyModifiers::NONE),
            Some(Action::ToggleLog)
        );
        assert_eq!(
            action_for(KeyCode::End, KeyModifiers::NONE),
            Some(Action::End)
        );
    }

    #[test]
    fn help_has_a_line_for_every_entry_within_its_width() {
        let lines = help_lines(64, "");
        for e in KEYMAP {
            assert!(lines.iter().any(|l| l.starts_with(e.keys)), "{}", e.keys);
        }
        assert!(lines.iter().all(|l| l.chars().count() <= 64), "{lines:#?}");
        let budget = help_lines(64, "BUDGET");
        assert!(budget.iter().any(|l| l.starts_with("+ / -")), "{budget:#?}");
        assert!(!budget.iter().any(|l| l.starts_with("g ")), "{budget:#?}");
    }
}
