//! `--plot FILE.svg|FILE.png`: one log-log panel per test, one line per column.

use super::tests::Test;
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

/// A measured size as the axis reads it: `8 B`, `4 KiB`, `1 MiB`.
fn size_label(s: usize) -> String {
    const UNITS: [(usize, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (u, name) in UNITS {
        if s >= u && s % u == 0 {
            return format!("{} {name}", s / u);
        }
    }
    format!("{s} B")
}

/// The unit as the tables' titles write it.
fn unit_label(test: Test) -> &'static str {
    match test.unit() {
        "us" => "µs",
        u => u,
    }
}

/// Ticks at 1, 2, 3 and 5 times each power of ten inside `lo..hi` (every multiple 1..9 where
/// that gives fewer than four): neighbours differ by at most a factor of two, so every point
/// can be read to within that.
fn value_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let (k0, k1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let ticks = |ms: &[f64]| {
        let mut v = vec![];
        for k in k0..=k1 {
            for &m in ms {
                // Divide for negative powers: 3.0 / 10.0 is 0.3, 3.0 * 0.1 is not.
                let t = if k < 0 {
                    m / 10f64.powi(-k)
                } else {
                    m * 10f64.powi(k)
                };
                if t >= lo && t <= hi {
                    v.push(t);
                }
            }
        }
        v
    };
    let v = ticks(&[1.0, 2.0, 3.0, 5.0]);
    if v.len() >= 4 {
        v
    } else {
        ticks(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    }
}

/// A tick value with as many decimals as its power of ten needs (0.05, 0.3, 2, 500).
fn value_label(v: f64) -> String {
    let decimals = (-v.log10().floor()).max(0.0) as usize;
    format!("{v:.decimals$}")
}

/// Draw `panels` into `path` (`.svg` or `.png`).
pub fn plot(path: &Path, title: &str, panels: &[(Test, Vec<Series>)]) -> Result<(), String> {
    load_font()?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    let h = HEIGHT * panels.len().max(1) as u32;
    match ext.as_deref() {
        Some("svg") => draw(
            SVGBackend::new(path, (WIDTH, h)).into_drawing_area(),
            title,
            panels,
        ),
        Some("png") => draw(
            BitMapBackend::new(path, (WIDTH, h)).into_drawing_area(),
            title,
            panels,
        ),
        _ => Err(format!(
            "--plot {}: the file must end in .svg or .png",
            path.display()
        )),
    }
}

const WIDTH: u32 = 900;
const HEIGHT: u32 = 480;

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
        // The x ticks are the sizes measured; the y ticks close enough to read every point.
        let mut sizes: Vec<f64> = pts.iter().map(|p| p.0).collect();
        sizes.sort_by(f64::total_cmp);
        sizes.dedup();
        let (ylo, yhi) = (ymin / 1.5, ymax * 1.5);
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(
                (xmin / 1.5..xmax * 1.5).log_scale().with_key_points(sizes),
                (ylo..yhi)
                    .log_scale()
                    .with_key_points(value_ticks(ylo, yhi)),
            )
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("message size")
            .y_desc(unit_label(*test))
            .x_label_formatter(&|x| size_label(x.round() as usize))
            .y_label_formatter(&|y| value_label(*y))
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

#[cfg(test)]
mod t {
    use super::*;

    /// The text of every `<text>` element of an SVG, in order.
    fn texts(svg: &str) -> Vec<String> {
        let mut v = vec![];
        let mut rest = svg;
        while let Some(i) = rest.find("<text") {
            rest = &rest[i..];
            let Some(open) = rest.find('>') else { break };
            let Some(close) = rest.find("</text>") else {
                break;
            };
            v.push(rest[open + 1..close].trim().to_string());
            rest = &rest[close..];
        }
        v
    }

    #[test]
    fn ticks_and_labels() {
        assert_eq!(size_label(8), "8 B");
        assert_eq!(size_label(4096), "4 KiB");
        assert_eq!(size_label(1 << 20), "1 MiB");
        assert_eq!(size_label(1000), "1000 B");
        assert_eq!(value_label(0.3), "0.3");
        assert_eq!(value_label(0.05), "0.05");
        assert_eq!(value_label(500.0), "500");
        let t = value_ticks(0.34 / 1.5, 0.5 * 1.5);
        assert_eq!(t, vec![0.3, 0.4, 0.5, 0.6, 0.7]);
        // Neighbouring ticks differ by at most a factor of two.
        let t = value_ticks(0.01, 30000.0);
        assert!(t.windows(2).all(|w| w[1] / w[0] <= 2.0 + 1e-9), "{t:?}");
    }

    /// The axis labels of a latency panel (0.34-0.5 µs: its only labels used to be 1.0 and 2.0,
    /// in "us", with x ticks at 10, 100, 1000) and a bandwidth panel.
    #[test]
    fn svg_axis_labels() {
        if let Err(e) = load_font() {
            if std::env::var_os("WEFT_REQUIRE_TOOLS").is_some_and(|v| v == "1") {
                panic!("required by WEFT_REQUIRE_TOOLS=1: {e}");
            }
            eprintln!("SKIP: {e}");
            return;
        }
        let panels = vec![
            (
                Test::Latency,
                vec![
                    Series {
                        label: "shm".into(),
                        baseline: false,
                        points: vec![(8, 0.34), (4096, 0.5)],
                    },
                    Series {
                        label: "ucx:posix".into(),
                        baseline: true,
                        points: vec![(8, 0.36), (4096, 0.48)],
                    },
                ],
            ),
            (
                Test::Bw,
                vec![Series {
                    label: "tcp-sim".into(),
                    baseline: false,
                    points: vec![(8, 9.5), (65536, 2100.0), (1 << 20, 4200.0)],
                }],
            ),
        ];
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT * 2)).into_drawing_area();
            draw(root, "weft bench", &panels).expect("draw");
        }
        insta::assert_snapshot!(texts(&svg).join("\n"));
    }
}
