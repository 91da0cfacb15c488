//! Self-contained SVG plots: the latency CDF of a fanout (log-scaled milliseconds against the
//! share of deliveries) and a per-second histogram (reconnects after a drain).

use std::{fmt::Write as _, io, path::Path};

use hdrhistogram::Histogram;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

fn frame(title: &str, x_label: &str, y_label: &str) -> String {
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>
<line x1="{LEFT}" y1="{}" x2="{}" y2="{}" stroke="black"/>
<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{}" stroke="black"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>
"#,
        WIDTH / 2.0,
        escape(title),
        HEIGHT - BOTTOM,
        WIDTH - RIGHT,
        HEIGHT - BOTTOM,
        HEIGHT - BOTTOM,
        LEFT + (WIDTH - LEFT - RIGHT) / 2.0,
        HEIGHT - 12.0,
        escape(x_label),
        TOP + (HEIGHT - TOP - BOTTOM) / 2.0,
        TOP + (HEIGHT - TOP - BOTTOM) / 2.0,
        escape(y_label),
    );
    svg
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn plot_x(fraction: f64) -> f64 {
    LEFT + fraction * (WIDTH - LEFT - RIGHT)
}

fn plot_y(fraction: f64) -> f64 {
    HEIGHT - BOTTOM - fraction * (HEIGHT - TOP - BOTTOM)
}

/// Share of deliveries (y) at or below a latency (x, log scale, ms), with p50/p99/p99.9 marked.
pub fn latency_cdf(path: &Path, title: &str, histogram: &Histogram<u64>) -> io::Result<()> {
    let mut svg = frame(title, "latency (ms, log scale)", "share of deliveries");
    if histogram.is_empty() {
        svg.push_str("</svg>\n");
        return std::fs::write(path, svg);
    }
    let low = (histogram.min().max(1) as f64 / 1000.0).log10().floor();
    let high = (histogram.max().max(2) as f64 / 1000.0)
        .log10()
        .ceil()
        .max(low + 1.0);
    let x_of = |ms: f64| plot_x((ms.max(1e-3).log10() - low) / (high - low));
    let mut decade = low;
    while decade <= high {
        let x = x_of(10f64.powf(decade));
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
            HEIGHT - BOTTOM,
            HEIGHT - BOTTOM + 16.0,
            10f64.powf(decade)
        );
        decade += 1.0;
    }
    for share in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{share}</text>"#,
            LEFT - 6.0,
            plot_y(share) + 4.0
        );
    }
    let total = histogram.len() as f64;
    let mut points = String::new();
    let mut cumulative = 0u64;
    for value in histogram.iter_recorded() {
        cumulative += value.count_at_value();
        let ms = histogram.highest_equivalent(value.value_iterated_to()) as f64 / 1000.0;
        let _ = write!(
            points,
            "{:.1},{:.1} ",
            x_of(ms),
            plot_y(cumulative as f64 / total)
        );
    }
    let _ = writeln!(
        svg,
        r##"<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{points}"/>"##
    );
    for (label, q) in [("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999)] {
        let ms = histogram.value_at_quantile(q) as f64 / 1000.0;
        let (x, y) = (x_of(ms), plot_y(q));
        let _ = writeln!(
            svg,
            r##"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="#d62728"/><text x="{:.1}" y="{:.1}">{label} {ms:.2} ms</text>"##,
            x + 6.0,
            y + 14.0
        );
    }
    svg.push_str("</svg>\n");
    std::fs::write(path, svg)
}

/// Bars of how many values fall into each one-second bucket.
pub fn histogram(path: &Path, title: &str, x_label: &str, seconds: &[f64]) -> io::Result<()> {
    let mut svg = frame(title, x_label, "clients per second");
    // One bucket per started second, up to the one holding the largest value.
    let count = seconds.iter().copied().fold(0.0, f64::max).floor() as usize + 1;
    let mut buckets = vec![0usize; count];
    for s in seconds {
        buckets[(*s as usize).min(count - 1)] += 1;
    }
    let peak = buckets.iter().copied().max().unwrap_or(0).max(1) as f64;
    let width = (WIDTH - LEFT - RIGHT) / buckets.len() as f64;
    for (i, count) in buckets.iter().enumerate() {
        let top = plot_y(*count as f64 / peak);
        let _ = writeln!(
            svg,
            r##"<rect x="{:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="#1f77b4"/>"##,
            plot_x(i as f64 / buckets.len() as f64),
            (width - 1.0).max(0.5),
            plot_y(0.0) - top
        );
    }
    let step = (buckets.len() / 10).max(1);
    for i in (0..buckets.len()).step_by(step) {
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{i}</text>"#,
            plot_x(i as f64 / buckets.len() as f64) + width / 2.0,
            HEIGHT - BOTTOM + 16.0
        );
    }
    for share in [0.0, 0.5, 1.0] {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{:.0}</text>"#,
            LEFT - 6.0,
            plot_y(share) + 4.0,
            share * peak
        );
    }
    svg.push_str("</svg>\n");
    std::fs::write(path, svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_are_well_formed_svg() {
        let dir = std::env::temp_dir().join(format!("posthorn-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).unwrap();
        for us in [500, 800, 1_200, 3_000, 45_000] {
            h.record(us).unwrap();
        }
        let cdf = dir.join("cdf.svg");
        latency_cdf(&cdf, "a <title>", &h).unwrap();
        let text = std::fs::read_to_string(&cdf).unwrap();
        assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
        assert!(text.contains("polyline") && text.contains("a &lt;title&gt;"));
        let bars = dir.join("bars.svg");
        histogram(&bars, "t", "s", &[0.5, 1.5, 1.7, 9.2]).unwrap();
        let text = std::fs::read_to_string(&bars).unwrap();
        assert_eq!(
            text.matches("<rect").count(),
            1 + 10,
            "background + 10 buckets"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
