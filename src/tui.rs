//! The interactive dashboard: app state and actions ([`app`]), the planner worker ([`worker`]),
//! drawing ([`view`]) and the event loop below.

pub mod app;
pub mod view;
pub mod worker;

use std::io::IsTerminal;
use std::time::Duration;

use crossterm::event::{
    DisableMouseCapture, EnableMouseCapture, Event, EventStream, KeyCode, KeyEventKind,
    KeyModifiers, MouseEventKind,
};
use crossterm::execute;
use ratatui::backend::TestBackend;
use ratatui::Terminal;

use app::{Action, App};

/// Map a key to an action.
pub fn action_for(code: KeyCode, modifiers: KeyModifiers) -> Option<Action> {
    Some(match code {
        KeyCode::Char('q') | KeyCode::Esc => Action::Quit,
        KeyCode::Char('c') if modifiers.contains(KeyModifiers::CONTROL) => Action::Quit,
        KeyCode::Char('+') | KeyCode::Char('=') => Action::RaiseBudget,
        KeyCode::Char('-') | KeyCode::Char('_') => Action::LowerBudget,
        KeyCode::Char(']') => Action::SplitUp,
        KeyCode::Char('[') => Action::SplitDown,
        KeyCode::Char('b') => Action::CycleBatch,
        KeyCode::Char('B') => Action::CycleGlobalBatch,
        KeyCode::Char('p') => Action::CyclePin,
        KeyCode::Char('?') => Action::ToggleHelp,
        KeyCode::Char('g') => Action::ToggleGraph,
        KeyCode::Char('s') => Action::StartRun,
        KeyCode::Char('x') => Action::StopRun,
        KeyCode::Char('r') => Action::RestartRun,
        KeyCode::Char('y') => Action::Yes,
        KeyCode::Char('n') => Action::No,
        KeyCode::Char('d') => Action::Detach,
        KeyCode::Tab => Action::FocusNext,
        KeyCode::Up | KeyCode::Char('k') => Action::Up,
        KeyCode::Down | KeyCode::Char('j') => Action::Down,
        KeyCode::PageUp => Action::PageUp,
        KeyCode::PageDown => Action::PageDown,
        KeyCode::Enter | KeyCode::Char(' ') => Action::Toggle,
        _ => return None,
    })
}

/// Render one frame of the app as text (for `--once` and when stdout is not a terminal).
pub fn render_text(app: &App, width: u16, height: u16) -> String {
    let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("test backend");
    terminal
        .draw(|f| view::draw(app, f))
        .expect("drawing into memory");
    let buf = terminal.backend().buffer();
    let mut out = String::new();
    for y in 0..buf.area.height {
        let mut line = String::new();
        for x in 0..buf.area.width {
            line.push_str(buf[(x, y)].symbol());
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Whether to draw interactively.
pub fn interactive(once: bool) -> bool {
    !once && std::io::stdout().is_terminal()
}

/// Run the dashboard until the user quits: a tokio loop over terminal events and a frame tick
/// that collects what the planner and the GPU poller produced.
pub fn run(app: App) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    runtime.block_on(run_loop(app))
}

async fn run_loop(mut app: App) -> std::io::Result<()> {
    use futures_util::StreamExt;

    let mut terminal = ratatui::init();
    // The wheel scrolls the focused panel; a terminal that refuses mouse capture still works.
    let _ = execute!(std::io::stdout(), EnableMouseCapture);
    let mut events = EventStream::new();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let result: std::io::Result<()> = async {
        while !app.quit {
            app.poll_background();
            terminal.draw(|f| view::draw(&app, f))?;
            tokio::select! {
                event = events.next() => match event {
                    Some(Ok(Event::Key(k))) if k.kind == KeyEventKind::Press => {
                        if let Some(a) = action_for(k.code, k.modifiers) {
                            app.update(a);
                        }
                    }
                    Some(Ok(Event::Mouse(m))) => match m.kind {
                        MouseEventKind::ScrollUp => app.update(Action::Up),
                        MouseEventKind::ScrollDown => app.update(Action::Down),
                        _ => {}
                    },
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e),
                    None => break,
                },
                _ = tick.tick() => {}
            }
        }
        Ok(())
    }
    .await;
    let _ = execute!(std::io::stdout(), DisableMouseCapture);
    ratatui::restore();
    result
}
