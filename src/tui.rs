//! The interactive dashboard: app state and actions ([`app`]), the keys ([`keymap`]), the
//! planner's background thread ([`planner_thread`]), the memory panel's figures ([`memory`]),
//! drawing ([`view`]) in one set of colours ([`theme`]), and the event loop below.

pub mod app;
pub mod cmdline;
pub mod keymap;
pub mod memory;
pub mod planner_thread;
pub mod theme;
pub mod view;

use std::io::IsTerminal;
use std::time::Duration;

use crossterm::event::{
    DisableMouseCapture, EnableMouseCapture, Event, EventStream, KeyEventKind, MouseEventKind,
};
use crossterm::execute;
use ratatui::backend::TestBackend;
use ratatui::Terminal;

pub use keymap::action_for;

use app::{Action, App};

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
            // A no-break space (a figure and its unit kept together) reads as a space.
            line.push_str(&buf[(x, y)].symbol().replace(view::NBSP, " "));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Every cell's colours back to the terminal's own; bold, reverse and the rest stay, so the
/// cursor, the focus and the bars still read.
pub fn strip_colors(buf: &mut ratatui::buffer::Buffer) {
    use ratatui::style::Color;
    for cell in buf.content.iter_mut() {
        cell.set_fg(Color::Reset);
        cell.set_bg(Color::Reset);
    }
}

/// Whether to draw interactively.
pub fn interactive(once: bool) -> bool {
    !once && std::io::stdout().is_terminal()
}

/// Run the dashboard until the user quits: a tokio loop over terminal events and a frame tick
/// that collects what the planner and the GPU poller produced. What the app has to say once
/// the terminal is back (after a detach: where the run goes on).
pub fn event_loop(app: App) -> std::io::Result<Option<String>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .enable_io()
        .build()?;
    runtime.block_on(run_loop(app))
}

async fn run_loop(mut app: App) -> std::io::Result<Option<String>> {
    use futures_util::StreamExt;

    let mut terminal = ratatui::init();
    // The wheel scrolls the focused panel; a terminal that refuses mouse capture still works.
    let _ = execute!(std::io::stdout(), EnableMouseCapture);
    let mut events = EventStream::new();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    // SIGTERM (a `kill`) and SIGHUP (the terminal closed) end the loop like `q`, so the
    // terminal is given back as it was; a run this dashboard started then finishes its step
    // and checkpoints (its lifeline closes), as when the dashboard dies.
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut hup = signal(SignalKind::hangup())?;
    let no_color = crate::env::no_color();
    let result: std::io::Result<()> = async {
        while !app.quit {
            app.poll_background();
            if let Ok(size) = terminal.size() {
                app.screen = (size.width, size.height);
            }
            terminal.draw(|f| {
                view::draw(&app, f);
                if no_color {
                    strip_colors(f.buffer_mut());
                }
            })?;
            tokio::select! {
                event = events.next() => match event {
                    Some(Ok(Event::Key(k))) if k.kind == KeyEventKind::Press => {
                        app.key(k.code, k.modifiers);
                    }
                    Some(Ok(Event::Mouse(m))) => match m.kind {
                        MouseEventKind::ScrollUp => app.update(Action::Up),
                        MouseEventKind::ScrollDown => app.update(Action::Down),
                        MouseEventKind::Down(crossterm::event::MouseButton::Left) => {
                            app.click(m.column, m.row)
                        }
                        _ => {}
                    },
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e),
                    None => break,
                },
                _ = tick.tick() => {}
                _ = term.recv() => break,
                _ = hup.recv() => break,
            }
        }
        Ok(())
    }
    .await;
    let _ = execute!(std::io::stdout(), DisableMouseCapture);
    ratatui::restore();
    result.map(|()| app.farewell.take())
}
