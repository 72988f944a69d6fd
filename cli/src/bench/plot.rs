//! `--plot FILE.svg|FILE.png`: one log-log panel per test, one line per column.

use super::tests::{fmt_size, Test};
use plotters::prelude::*;
use std::path::Path;

/// One line of a panel.
pub struct Series {
    pub label: String,
    pub baseline: bool,
    /// (size, median); sizes of 0 are not drawn on a log axis.
    pub points: Vec<(usize, f64)>,
}

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

fn load_font() -> Result<(), String> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = FONT_PATHS
            .iter()
            .find_map(|p| std::fs::read(p).ok())
            .ok_or_else(|| {
                "no TrueType font for plot labels; install Debian's fonts-dejavu-core".to_string()
            })?;
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| "the plot font could not be read".to_string())
    })
    .clone()
}

const COLORS: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Draw `panels` into `path` (`.svg` or `.png`).
pub fn plot(path: &Path, title: &str, panels: &[(Test, Vec<Series>)]) -> Result<(), String> {
    load_font()?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    let h = 480 * panels.len().max(1) as u32;
    match ext.as_deref() {
        Some("svg") => draw(
            SVGBackend::new(path, (900, h)).into_drawing_area(),
            title,
            panels,
        ),
        Some("png") => draw(
            BitMapBackend::new(path, (900, h)).into_drawing_area(),
            title,
            panels,
        ),
        _ => Err(format!(
            "--plot {}: the file must end in .svg or .png",
            path.display()
        )),
    }
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    panels: &[(Test, Vec<Series>)],
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    for (area, (test, series)) in areas.iter().zip(panels) {
        let pts: Vec<(f64, f64)> = series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|(x, y)| *x > 0 && *y > 0.0 && y.is_finite())
            .map(|(x, y)| (*x as f64, *y))
            .collect();
        if pts.is_empty() {
            continue;
        }
        let (xmin, xmax) = pts
            .iter()
            .fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.0), a.1.max(p.0)));
        let (ymin, ymax) = pts
            .iter()
            .fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.1), a.1.max(p.1)));
        let caption = format!("{title}: {} ({})", test.name(), test.describe());
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(
                (xmin / 1.5..xmax * 1.5).log_scale(),
                (ymin / 1.5..ymax * 1.5).log_scale(),
            )
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("message size (bytes)")
            .y_desc(test.unit())
            .x_label_formatter(&|x| fmt_size(*x as usize))
            .draw()
            .map_err(err)?;
        for (i, s) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let data: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter(|(x, y)| *x > 0 && *y > 0.0 && y.is_finite())
                .map(|(x, y)| (*x as f64, *y))
                .collect();
            let stroke = if s.baseline { 1 } else { 2 };
            let label = if s.baseline {
                format!("{} (baseline)", s.label)
            } else {
                s.label.clone()
            };
            chart
                .draw_series(LineSeries::new(data.clone(), color.stroke_width(stroke)))
                .map_err(err)?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(stroke))
                });
            let filled = !s.baseline;
            chart
                .draw_series(data.into_iter().map(move |p| {
                    Circle::new(
                        p,
                        3,
                        if filled {
                            color.filled()
                        } else {
                            color.stroke_width(1)
                        },
                    )
                }))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(if test.higher_is_better() {
                SeriesLabelPosition::LowerRight
            } else {
                SeriesLabelPosition::UpperLeft
            })
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
