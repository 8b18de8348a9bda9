//! The dashboard's colours, by meaning: every style the view draws with comes from here, so a
//! colour means one thing everywhere (green good, yellow attention, red over budget or failed,
//! grey secondary) and a new palette is a one-file change.

use ratatui::style::{Color, Modifier, Style};

use crate::run::RunState;
use osdp_core::cost::{Choice, Colour};

/// Secondary text: column heads, hints, log lines.
pub const MUTED: Style = Style::new().fg(Color::DarkGray);
/// Good news: a throughput, a calibrated layout, the frontier curve.
pub const GOOD: Style = Style::new().fg(Color::Green);
pub const GOOD_BOLD: Style = Style::new().fg(Color::Green).add_modifier(Modifier::BOLD);
/// Needs attention: uncalibrated prices, notices, a plan that differs from the run's.
pub const WARN: Style = Style::new().fg(Color::Yellow);
/// Over budget, failed, nothing fits.
pub const BAD: Style = Style::new().fg(Color::Red).add_modifier(Modifier::BOLD);
/// A limit drawn as a line (the budget on the frontier chart, memory over it).
pub const LIMIT: Style = Style::new().fg(Color::Red);
/// A question waiting for an answer (footer).
pub const PROMPT: Style = Style::new().fg(Color::Black).bg(Color::Yellow);
/// Measured series: memory sparklines, the loss curve.
pub const SERIES: Style = Style::new().fg(Color::Cyan);
/// Ops whose activations are recomputed (distinct from every strategy colour).
pub const RECOMPUTE: Style = Style::new().fg(Color::Magenta);
/// Someone else's run, followed read-only.
pub const ATTACHED: Style = Style::new().fg(Color::Cyan);
/// The selected row: reverse video, which a terminal shows without any colour (`NO_COLOR`).
pub const SELECTED: Style = Style::new().add_modifier(Modifier::REVERSED);

/// The parts of a plan's memory in the header's bar: model states, kept activations, the
/// largest transient, the runtime's own (CUDA context, NCCL, allocator).
pub const MEMORY_PARTS: [Color; 4] = [Color::Blue, Color::Green, Color::Yellow, Color::DarkGray];
/// The parts of a step's time: compute, recompute, exposed communication, optimizer, fixed
/// per-step overhead.
pub const TIME_PARTS: [Color; 5] = [
    Color::Green,
    Color::Magenta,
    Color::Cyan,
    Color::Blue,
    Color::DarkGray,
];

/// A panel's border lines: double when it has the keys, which shows without colour too.
pub const fn border_type(focused: bool) -> ratatui::widgets::BorderType {
    if focused {
        ratatui::widgets::BorderType::Double
    } else {
        ratatui::widgets::BorderType::Plain
    }
}

/// A panel's border: bright when it has the keys.
pub const fn border(focused: bool) -> Style {
    if focused {
        Style::new().fg(Color::White)
    } else {
        MUTED
    }
}

/// Colour of a strategy badge: the strategy's own ([`Strategy::ALL`]); split zero3 has its
/// own (not recompute's), and offloaded state (to host memory) has one whatever the sharding.
pub const fn strategy(c: Choice) -> Color {
    if !matches!(c.offload, osdp_core::cost::Offload::None) {
        return Color::LightGreen;
    }
    if c.split > 1 {
        return Color::LightRed;
    }
    colour(c.strategy.info().colour)
}

/// A strategy's letter in the strip of the whole model, which reads without colour too: `D`
/// dp, `1` `2` `3` zero1–3, `s` split zero3, `H` hsdp, `o` offloaded state.
pub const fn strategy_letter(c: Choice) -> char {
    use osdp_core::cost::Strategy;
    if !matches!(c.offload, osdp_core::cost::Offload::None) {
        return 'o';
    }
    if c.split > 1 {
        return 's';
    }
    match c.strategy {
        Strategy::None => ' ',
        Strategy::Dp => 'D',
        Strategy::Zero1 => '1',
        Strategy::Zero2 => '2',
        Strategy::Zero3 => '3',
        Strategy::Hsdp => 'H',
    }
}

/// The strip's letters, for help.
pub const STRIP_LETTERS: &str =
    "strip of the model: D dp · 1 zero1 · 2 zero2 · 3 zero3 · s zero3/K:M · H hsdp · o offloaded";

/// A colour the core names, in the terminal's terms.
pub const fn colour(c: Colour) -> Color {
    match c {
        Colour::DarkGray => Color::DarkGray,
        Colour::Blue => Color::Blue,
        Colour::LightBlue => Color::LightBlue,
        Colour::Cyan => Color::Cyan,
        Colour::Green => Color::Green,
        Colour::LightGreen => Color::LightGreen,
        Colour::Yellow => Color::Yellow,
        Colour::LightRed => Color::LightRed,
    }
}

/// Colour of a training run's state.
pub const fn run_state(state: &RunState) -> Color {
    match state {
        RunState::Idle | RunState::Stopped => Color::DarkGray,
        RunState::Starting | RunState::Checkpointing | RunState::Stopping => Color::Yellow,
        RunState::Running => Color::Green,
        RunState::Failed { .. } => Color::Red,
    }
}
