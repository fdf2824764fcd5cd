//! PNG plots of a throughput run (plotters' bitmap backend). Text is drawn with `ab_glyph` from
//! a font file registered once ([`register_font`]), so no system font library is needed.

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

use crate::report::Report;

const SIZE: (u32, u32) = (900, 560);

/// Makes `font` (a TrueType file's bytes) the plots' `sans-serif`.
///
/// # Errors
/// When the bytes are not a font.
pub fn register_font(font: Vec<u8>) -> anyhow::Result<()> {
    let bytes: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("the plot font is not a TrueType font"))
}

fn title(report: &Report) -> String {
    format!(
        "{} x {:?} ({}, SKU {}), {}, {} worker(s), {} build",
        report.jobs, report.code, report.mode, report.sku, report.load, report.workers, report.build
    )
}

/// Histogram of submitted -> finished latencies (ms), with p50 and p99 marked.
///
/// # Errors
/// When drawing or writing the file fails.
pub fn latency_histogram(path: &Path, latencies: &[u64], report: &Report) -> anyhow::Result<()> {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let max = latencies.iter().copied().max().unwrap_or(1).max(1);
    let bins = 40u64;
    let width = max.div_ceil(bins).max(1);
    let mut counts = vec![0u32; (max / width + 1) as usize];
    for &l in latencies {
        counts[(l / width) as usize] += 1;
    }
    let top = counts.iter().copied().max().unwrap_or(1).max(1);
    let x_end = (counts.len() as u64 * width) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("submitted -> finished: {}", title(report)), ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..x_end, 0u32..top + top / 10 + 1)?;
    chart
        .configure_mesh()
        .x_label_formatter(&|v| format!("{v:.0}"))
        .x_desc("submitted -> finished (ms)")
        .y_desc("jobs")
        .label_style(("sans-serif", 14))
        .draw()?;
    chart.draw_series(counts.iter().enumerate().map(|(i, &c)| {
        let x0 = i as f64 * width as f64;
        Rectangle::new([(x0, 0), (x0 + width as f64, c)], BLUE.mix(0.6).filled())
    }))?;
    let p = report.submitted_to_finished_ms;
    for (value, label, colour) in [(p.p50, "p50", GREEN), (p.p99, "p99", RED)] {
        chart
            .draw_series(LineSeries::new([(value as f64, 0), (value as f64, top)], colour.stroke_width(2)))?
            .label(format!("{label} {value} ms"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).label_font(("sans-serif", 14)).draw()?;
    root.present().with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// Per-second counts of `times` (ms since the start) as (second, count) points.
fn per_second(times: &[u64], seconds: usize) -> Vec<(f64, u32)> {
    let mut counts = vec![0u32; seconds];
    for &t in times {
        if let Some(c) = counts.get_mut((t / 1000) as usize) {
            *c += 1;
        }
    }
    counts.into_iter().enumerate().map(|(s, c)| (s as f64 + 0.5, c)).collect()
}

/// Submitted and finished jobs per second (top) and the queue depth (bottom) over time.
///
/// # Errors
/// When drawing or writing the file fails.
pub fn throughput(path: &Path, submitted: &[u64], finished: &[u64], depth: &[(u64, u32)], report: &Report) -> anyhow::Result<()> {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let (upper, lower) = root.split_vertically(SIZE.1 * 3 / 5);
    let end_ms = finished.iter().chain(submitted).copied().chain(depth.iter().map(|d| d.0)).max().unwrap_or(1000);
    let seconds = (end_ms / 1000 + 1) as usize;
    let submitted = per_second(submitted, seconds);
    let finished = per_second(finished, seconds);
    let top = submitted.iter().chain(&finished).map(|p| p.1).max().unwrap_or(1).max(1);
    let mut chart = ChartBuilder::on(&upper)
        .caption(format!("throughput: {}", title(report)), ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..seconds as f64, 0u32..top + top / 10 + 1)?;
    chart.configure_mesh().x_label_formatter(&|v| format!("{v:.0}")).y_desc("jobs / s").label_style(("sans-serif", 14)).draw()?;
    for (series, label, colour) in [(&submitted, "submitted", BLUE), (&finished, "finished", GREEN)] {
        chart
            .draw_series(LineSeries::new(series.iter().copied(), colour.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).label_font(("sans-serif", 14)).draw()?;
    let deepest = depth.iter().map(|d| d.1).max().unwrap_or(0).max(1);
    let mut chart = ChartBuilder::on(&lower)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..seconds as f64, 0u32..deepest + deepest / 10 + 1)?;
    chart
        .configure_mesh()
        .x_label_formatter(&|v| format!("{v:.0}"))
        .x_desc("seconds since the start")
        .y_desc("queue depth")
        .label_style(("sans-serif", 14))
        .draw()?;
    chart.draw_series(LineSeries::new(depth.iter().map(|&(t, d)| (t as f64 / 1000.0, d)), RED.stroke_width(2)))?;
    root.present().with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
