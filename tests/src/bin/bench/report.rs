//! The result table: one row per figure and metric, a value per path, the ratios the
//! targets are stated in, and whether the chain met its target.
//!
//! The same rows are printed as a text table and written as JSON, so what a person reads
//! and what a script compares can never disagree. A missing value (a path that could not
//! run here, a tool that is not installed) is `None`: printed as `n/a`, written as `null`,
//! and its target is reported as not evaluated rather than as met or missed.

use serde::Serialize;

/// One line of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Figure number from the benchmark issue (`"1"` .. `"8"`).
    pub figure: &'static str,
    /// What is measured, e.g. `RTT p50`.
    pub metric: String,
    /// Unit of the values.
    pub unit: &'static str,
    /// Value on the direct path (in the VM table: the app dialling vsock itself).
    pub direct: Option<f64>,
    /// Value on this project's chain (in the VM table: guest-init as the forwarder).
    pub chain: Option<f64>,
    /// Value on the naive tokio relay chain.
    pub naive: Option<f64>,
    /// Value on the socat chain (in the VM table: socat as the forwarder).
    pub socat: Option<f64>,
    /// The ratios the target is stated in, e.g. `chain/direct=1.31`.
    pub ratios: String,
    /// The target, as the issue states it; empty when the row has none.
    pub target: String,
    /// `Some(true)` met, `Some(false)` missed, `None` no target or not measurable here.
    pub pass: Option<bool>,
}

impl Row {
    /// A row with values and no target yet.
    pub fn new(
        figure: &'static str,
        metric: impl Into<String>,
        unit: &'static str,
        [direct, chain, naive, socat]: [Option<f64>; 4],
    ) -> Self {
        Row {
            figure,
            metric: metric.into(),
            unit,
            direct,
            chain,
            naive,
            socat,
            ratios: String::new(),
            target: String::new(),
            pass: None,
        }
    }

    /// Sets the target text and the verdict.
    pub fn target(mut self, target: impl Into<String>, pass: Option<bool>) -> Self {
        self.target = target.into();
        self.pass = pass;
        self
    }

    /// Sets the ratio text.
    pub fn ratios(mut self, ratios: String) -> Self {
        self.ratios = ratios;
        self
    }
}

/// `a / b` when both exist and `b` is not zero.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 => Some(a / b),
        _ => None,
    }
}

/// Formats a ratio for the table.
pub fn fmt_ratio(name: &str, r: Option<f64>) -> String {
    match r {
        Some(r) => format!("{name}={r:.2}"),
        None => format!("{name}=n/a"),
    }
}

fn fmt_value(v: Option<f64>) -> String {
    match v {
        None => "n/a".into(),
        Some(v) if v.abs() >= 100.0 => format!("{v:.0}"),
        Some(v) if v.abs() >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

/// The table as text, with the host paths' column names.
pub fn render(rows: &[Row]) -> String {
    render_with(
        rows,
        [Some("direct"), Some("chain"), Some("naive"), Some("socat")],
    )
}

/// The table as text, with these names for the four value columns (direct, chain,
/// naive, socat); a `None` name leaves that column out.
pub fn render_with(rows: &[Row], names: [Option<&str>; 4]) -> String {
    let mut header = vec!["fig", "metric", "unit"];
    header.extend(names.iter().flatten());
    header.extend(["ratios", "target", "result"]);
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut c = vec![r.figure.to_string(), r.metric.clone(), r.unit.to_string()];
            let values = [r.direct, r.chain, r.naive, r.socat];
            for (v, name) in values.into_iter().zip(names) {
                if name.is_some() {
                    c.push(fmt_value(v));
                }
            }
            c.push(r.ratios.clone());
            c.push(r.target.clone());
            c.push(match r.pass {
                Some(true) => "pass".into(),
                Some(false) => "MISS".into(),
                None if r.target.is_empty() => String::new(),
                None => "n/a".into(),
            });
            c
        })
        .collect();
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for c in &cells {
        for (w, s) in width.iter_mut().zip(c) {
            *w = (*w).max(s.chars().count());
        }
    }
    let line = |c: &[String]| {
        let mut out = String::from("|");
        for (s, &w) in c.iter().zip(&width) {
            out.push_str(&format!(" {s:<w$} |"));
        }
        out.push('\n');
        out
    };
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    let mut out = line(&header);
    out.push('|');
    for w in &width {
        out.push_str(&format!("{}|", "-".repeat(w + 2)));
    }
    out.push('\n');
    for c in &cells {
        out.push_str(&line(c));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_missing_values_and_verdicts() {
        let rows = vec![
            Row::new("1", "RTT p50", "us", [Some(40.0), Some(60.0), None, None])
                .ratios(fmt_ratio("chain/direct", ratio(Some(60.0), Some(40.0))))
                .target("<= 2x direct", Some(true)),
            Row::new("4", "burst ok", "conns", [None, Some(3.0), None, None])
                .target("5000 of 5000", Some(false)),
        ];
        let t = render(&rows);
        assert!(t.contains("chain/direct=1.50"), "{t}");
        assert!(t.contains("n/a"), "{t}");
        assert!(t.contains("pass") && t.contains("MISS"), "{t}");
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        let t = render_with(
            &rows,
            [Some("vsock"), Some("guest-init"), None, Some("socat")],
        );
        assert!(
            t.starts_with("| fig | metric   | unit  | vsock | guest-init | socat |"),
            "{t}"
        );
        assert!(!t.contains("naive"), "{t}");
    }
}
