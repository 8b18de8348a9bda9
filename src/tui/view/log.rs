//! The log view: the worker's output (`worker.log`) over the whole screen below the header's
//! first line, following its tail unless the user scrolled up.

use ratatui::layout::Rect;
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Clear, Paragraph};
use ratatui::Frame;

use super::super::app::App;
use super::super::theme;
use osdp_core::text::printable;

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
    let (top, _) = app.log_window();
    let first = tail.dropped();
    let total = first + tail.len() as u64;
    let following = app.log_view.is_none_or(|v| v.top.is_none());
    let width = usize::from(area.width.saturating_sub(2)).max(1);
    let rows = usize::from(area.height.saturating_sub(2));
    // Long lines wrap (a failure's message is often the longest): following, the view fills
    // up from the last line; scrolled, down from its top line.
    let line = |i: u64| -> Vec<Line<'static>> {
        let text = tail
            .get((i - first) as usize)
            .map(|l| printable(l).into_owned())
            .unwrap_or_default();
        if text.is_empty() {
            return vec![Line::from("")];
        }
        let chars: Vec<char> = text.chars().collect();
        chars
            .chunks(width)
            .map(|c| Line::from(c.iter().collect::<String>()))
            .collect()
    };
    let mut lines: Vec<Line> = Vec::new();
    let (from, to) = if following {
        let mut i = total;
        while i > first && lines.len() < rows {
            i -= 1;
            let mut l = line(i);
            l.append(&mut lines);
            lines = l;
        }
        (i, total)
    } else {
        let mut i = top;
        while i < total && lines.len() < rows {
            lines.extend(line(i));
            i += 1;
        }
        (top, i)
    };
    // Of a long first line that does not fit whole, its end.
    if lines.len() > rows {
        if following {
            lines.drain(..lines.len() - rows);
        } else {
            lines.truncate(rows);
        }
    }
    if lines.is_empty() {
        lines.push(Line::styled(
            "the worker has written nothing yet",
            theme::MUTED,
        ));
    }
    let range = if to == from {
        "empty".to_string()
    } else {
        format!("lines {}–{to} of {total}", from + 1)
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
    let border = match app.run_control.as_ref().map(|t| t.state()) {
        Some(s) => Style::new().fg(theme::run_state(&s)),
        None => theme::MUTED,
    };
    f.render_widget(
        Paragraph::new(lines).block(Block::bordered().title(title).border_style(border)),
        area,
    );
}
