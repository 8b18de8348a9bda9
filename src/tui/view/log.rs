//! The log view: the worker's output (`worker.log`) over the whole screen below the header's
//! first line, following its tail unless the user scrolled up.

use ratatui::layout::Rect;
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Clear, Paragraph};
use ratatui::Frame;

use super::super::app::App;
use super::super::theme;
use crate::text::printable;

pub fn draw_log(app: &App, f: &mut Frame, area: Rect) {
    f.render_widget(Clear, area);
    let Some(tail) = app.log_tail() else {
        f.render_widget(
            Paragraph::new("no run yet: s starts one, and its worker's output shows here")
                .block(Block::bordered().title(" worker log ")),
            area,
        );
        return;
    };
    let (top, shown) = app.log_window();
    let first = tail.dropped();
    let mut lines: Vec<Line> = (0..shown)
        .filter_map(|k| tail.get((top - first) as usize + k))
        .map(|l| Line::from(printable(l).into_owned()))
        .collect();
    if lines.is_empty() {
        lines.push(Line::styled(
            "the worker has written nothing yet",
            theme::MUTED,
        ));
    }
    let total = first + tail.len() as u64;
    let following = app.log_view.is_none_or(|v| v.top.is_none());
    let range = if shown == 0 {
        "empty".to_string()
    } else {
        format!("lines {}–{} of {total}", top + 1, top + shown as u64)
    };
    let state = if following {
        Span::styled("following ", theme::GOOD)
    } else {
        Span::styled("scrolled: End follows ", theme::WARN)
    };
    let path = printable(&tail.path().display().to_string()).into_owned();
    let mut title = Line::from(vec![
        Span::raw(format!(" worker log · {path} · {range} · ")),
        state.clone(),
    ]);
    // A narrow screen keeps where the view is and whether it follows; the path goes.
    if title.width() + 2 > usize::from(area.width) {
        title = Line::from(vec![Span::raw(format!(" worker log · {range} · ")), state]);
    }
    let border = match app.training.as_ref().map(|t| t.state()) {
        Some(s) => Style::new().fg(theme::run(&s)),
        None => theme::MUTED,
    };
    f.render_widget(
        Paragraph::new(lines).block(Block::bordered().title(title).border_style(border)),
        area,
    );
}
