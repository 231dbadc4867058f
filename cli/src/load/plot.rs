//! The load run's time series as one PNG page: memory against the worker's budget, the
//! concurrency admission reached, the records the gateway held, and throughput, over time.
//! Drawn with plotters into a pixel buffer and encoded with `image`; text needs a TrueType
//! font file (DejaVu Sans from Debian's `fonts-dejavu-core`, which `scripts/setup` installs).

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Context};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use super::sample::Series;

/// Where Debian's `fonts-dejavu-core` puts DejaVu Sans.
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
/// Most bytes a font file may have.
const MAX_FONT_BYTES: u64 = 16 << 20;
const SIZE: (u32, u32) = (1400, 1600);
const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// One panel: a title, a unit divisor and the columns drawn in it.
pub struct Panel {
    pub title: String,
    /// Each value is divided by this before it is drawn (1048576 for MiB).
    pub divisor: f64,
    pub columns: Vec<String>,
}

fn panels(series: &Series) -> Vec<Panel> {
    let with = |prefix: &str| -> Vec<String> {
        series.columns.iter().filter(|c| c.starts_with(prefix)).cloned().collect()
    };
    let mut concurrency = with("gateway_worker_calls_");
    concurrency.extend(with("gateway_permit_limit_"));
    concurrency.extend(["worker_batch_size_mean", "worker_queued_requests", "worker_oom_total"].map(String::from));
    let mut held = with("gateway_in_flight_");
    held.extend(["gateway_uncommitted", "consumer_lag"].map(String::from));
    vec![
        Panel {
            title: "Memory (MiB): worker budget, admitted estimate, used; gateway payload held".into(),
            divisor: 1048576.0,
            columns: ["worker_budget_bytes", "worker_admitted_bytes", "worker_used_bytes", "gateway_held_bytes"]
                .map(String::from)
                .into(),
        },
        Panel { title: "Concurrency: worker calls and permit limits per task, batch size, queue, OOMs".into(), divisor: 1.0, columns: concurrency },
        Panel { title: "Records held: gateway in flight per task, uncommitted, consumer lag".into(), divisor: 1.0, columns: held },
        Panel {
            title: "Throughput (records/s finished: results + dead letters)".into(),
            divisor: 1.0,
            columns: vec!["done_per_s".into()],
        },
    ]
}

fn load_font(path: &Path) -> anyhow::Result<()> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let size = std::fs::metadata(path).map_err(|e| {
            format!("no font at {}: {e}; install Debian's fonts-dejavu-core (scripts/setup does) or pass --font", path.display())
        })?;
        if size.len() > MAX_FONT_BYTES {
            return Err(format!("{} has {} bytes, more than a font's {MAX_FONT_BYTES}", path.display(), size.len()));
        }
        let bytes = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        // plotters keeps registered fonts for the life of the process; this is done once.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{} is not a TrueType/OpenType font plotters can read", path.display()))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

/// Draws `series` into a PNG at `out`, with text in the font at `font`.
pub fn write_png(series: &Series, out: &Path, font: &Path) -> anyhow::Result<()> {
    write_panels(series, &panels(series), out, font)
}

/// Draws `panels` of `series` (its first column is the time in seconds) into a PNG at `out`,
/// one above the other, with text in the font at `font`.
pub fn write_panels(series: &Series, panels: &[Panel], out: &Path, font: &Path) -> anyhow::Result<()> {
    load_font(font)?;
    let mut pixels = vec![255u8; (SIZE.0 * SIZE.1 * 3) as usize];
    draw(series, panels, &mut pixels).map_err(|e| anyhow!("drawing the plot: {e}"))?;
    image::save_buffer(out, &pixels, SIZE.0, SIZE.1, image::ExtendedColorType::Rgb8)
        .with_context(|| format!("writing {}", out.display()))
}

fn draw(series: &Series, panels: &[Panel], pixels: &mut [u8]) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::with_buffer(pixels, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    for (panel, area) in panels.iter().zip(&areas) {
        let lines: Vec<(String, Vec<(f64, f64)>)> = panel
            .columns
            .iter()
            .map(|c| (c.clone(), series.points(c).into_iter().map(|(t, v)| (t, v / panel.divisor)).collect::<Vec<_>>()))
            .filter(|(_, p)| !p.is_empty())
            .collect();
        let y_max = lines.iter().flat_map(|(_, p)| p.iter().map(|(_, v)| *v)).fold(1.0, f64::max) * 1.1;
        // Each panel spans its own points' time (a load run's columns share one clock).
        let t_max = lines.iter().flat_map(|(_, p)| p.iter().map(|(t, _)| *t)).fold(1.0, f64::max);
        let mut chart = ChartBuilder::on(area)
            .caption(panel.title.as_str(), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(80)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
        chart.configure_mesh().x_desc("seconds into the run").label_style(("sans-serif", 14)).draw()?;
        let labelled = !lines.is_empty();
        for (i, (name, points)) in lines.into_iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            chart
                .draw_series(LineSeries::new(points, colour.stroke_width(2)))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
        }
        if !labelled {
            continue;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
