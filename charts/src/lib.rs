//! Small PNG charts for training curves and benchmark reports: line charts in a grid of
//! panels and grouped bar charts, drawn on an RGB raster with a built-in bitmap font, so
//! nothing depends on system fonts (CI machines and GPU nodes rarely have them).

mod font;

use std::path::Path;

/// Errors of chart output.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    /// PNG encoding failed.
    #[error("encoding PNG")]
    Png(#[from] png::EncodingError),
    /// The file could not be written.
    #[error("writing {0}")]
    Io(std::path::PathBuf, #[source] std::io::Error),
}

/// An RGB colour.
pub type Rgb = [u8; 3];

/// Colours given to series in order.
pub const PALETTE: [Rgb; 6] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
];

/// The colour of text and axes.
pub const INK: Rgb = [40, 40, 40];
const GRID: Rgb = [225, 225, 225];

/// An RGB raster.
#[derive(Debug, Clone)]
pub struct Canvas {
    width: usize,
    height: usize,
    pixels: Vec<u8>,
}

impl Canvas {
    /// A white canvas.
    pub fn new(width: usize, height: usize) -> Self {
        Self {
            width,
            height,
            pixels: vec![255; width * height * 3],
        }
    }

    /// Width in pixels.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> usize {
        self.height
    }

    /// The colour at (x, y).
    pub fn pixel(&self, x: usize, y: usize) -> Rgb {
        let i = (y * self.width + x) * 3;
        [self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]]
    }

    /// Sets one pixel; outside the canvas is ignored.
    pub fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x < 0 || y < 0 || x as usize >= self.width || y as usize >= self.height {
            return;
        }
        let i = (y as usize * self.width + x as usize) * 3;
        self.pixels[i..i + 3].copy_from_slice(&c);
    }

    /// A filled rectangle.
    pub fn fill_rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: Rgb) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.set(xx, yy, c);
            }
        }
    }

    /// A straight line, `thick` pixels wide.
    pub fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: Rgb, thick: i64) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.fill_rect(x - thick / 2, y - thick / 2, thick, thick, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Text with its top-left corner at (x, y), each font pixel drawn `scale` pixels wide.
    pub fn text(&mut self, x: i64, y: i64, s: &str, c: Rgb, scale: i64) {
        for (k, ch) in s.chars().enumerate() {
            let ox = x + (k * font::ADVANCE) as i64 * scale;
            match font::glyph(ch) {
                Some(rows) => {
                    for (r, row) in rows.iter().enumerate() {
                        for (col, b) in row.bytes().enumerate() {
                            if b == b'#' {
                                self.fill_rect(
                                    ox + col as i64 * scale,
                                    y + r as i64 * scale,
                                    scale,
                                    scale,
                                    c,
                                );
                            }
                        }
                    }
                }
                None => {
                    for r in 0..font::HEIGHT as i64 {
                        self.set(ox, y + r * scale, c);
                        self.set(ox + 4 * scale, y + r * scale, c);
                    }
                }
            }
        }
    }

    /// Width of `s` drawn at `scale`.
    pub fn text_width(s: &str, scale: i64) -> i64 {
        (s.chars().count() * font::ADVANCE) as i64 * scale
    }

    /// Copies `other` with its top-left corner at (x, y).
    pub fn blit(&mut self, other: &Canvas, x: usize, y: usize) {
        for yy in 0..other.height {
            for xx in 0..other.width {
                self.set((x + xx) as i64, (y + yy) as i64, other.pixel(xx, yy));
            }
        }
    }

    /// PNG bytes.
    pub fn to_png(&self) -> Result<Vec<u8>, ChartError> {
        let mut out = Vec::new();
        {
            let mut enc = png::Encoder::new(&mut out, self.width as u32, self.height as u32);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut w = enc.write_header()?;
            w.write_image_data(&self.pixels)?;
        }
        Ok(out)
    }

    /// Writes a PNG file.
    pub fn save_png(&self, path: &Path) -> Result<(), ChartError> {
        let bytes = self.to_png()?;
        std::fs::write(path, bytes).map_err(|e| ChartError::Io(path.to_path_buf(), e))
    }
}

/// One named curve.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// (x, y) points; non-finite ones are skipped.
    pub points: Vec<(f64, f64)>,
}

/// A line chart: one panel.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LineChart {
    /// Title above the plot.
    pub title: String,
    /// Label of the x axis.
    pub x_label: String,
    /// The curves.
    pub series: Vec<Series>,
}

/// Bounds that include every finite point, padded so flat curves still show.
fn bounds(points: impl Iterator<Item = (f64, f64)>) -> Option<(f64, f64, f64, f64)> {
    let (mut x0, mut x1, mut y0, mut y1) = (
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::INFINITY,
        f64::NEG_INFINITY,
    );
    let mut any = false;
    for (x, y) in points.filter(|(x, y)| x.is_finite() && y.is_finite()) {
        any = true;
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if !any {
        return None;
    }
    if x1 - x0 < 1e-12 {
        x0 -= 0.5;
        x1 += 0.5;
    }
    if y1 - y0 < 1e-12 {
        let pad = y0.abs().max(1.0) * 0.05;
        y0 -= pad;
        y1 += pad;
    }
    let pad = (y1 - y0) * 0.05;
    Some((x0, x1, y0 - pad, y1 + pad))
}

/// A tick label: short, with an exponent only for very large or small values.
pub fn tick_label(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{v:.1e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

impl LineChart {
    /// Draws the chart on a `width` x `height` canvas.
    pub fn render(&self, width: usize, height: usize) -> Canvas {
        let mut c = Canvas::new(width, height);
        let (left, right, top, bottom) = (70i64, 12i64, 30i64, 34i64);
        let (pw, ph) = (width as i64 - left - right, height as i64 - top - bottom);
        c.text(left, 8, &self.title, INK, 2);
        let Some((x0, x1, y0, y1)) =
            bounds(self.series.iter().flat_map(|s| s.points.iter().copied()))
        else {
            c.text(left, top + ph / 2, "NO DATA", INK, 2);
            return c;
        };
        let px = |x: f64| left + ((x - x0) / (x1 - x0) * pw as f64).round() as i64;
        let py = |y: f64| top + ph - ((y - y0) / (y1 - y0) * ph as f64).round() as i64;
        for k in 0..=4 {
            let t = k as f64 / 4.0;
            let yv = y0 + (y1 - y0) * t;
            let y = py(yv);
            c.line((left, y), (left + pw, y), GRID, 1);
            let label = tick_label(yv);
            c.text(
                left - 6 - Canvas::text_width(&label, 1),
                y - 3,
                &label,
                INK,
                1,
            );
            let xv = x0 + (x1 - x0) * t;
            let x = px(xv);
            c.line((x, top), (x, top + ph), GRID, 1);
            let label = tick_label(xv);
            c.text(
                x - Canvas::text_width(&label, 1) / 2,
                top + ph + 6,
                &label,
                INK,
                1,
            );
        }
        c.line((left, top), (left, top + ph), INK, 1);
        c.line((left, top + ph), (left + pw, top + ph), INK, 1);
        c.text(
            left + pw / 2 - Canvas::text_width(&self.x_label, 1) / 2,
            top + ph + 20,
            &self.x_label,
            INK,
            1,
        );
        for (k, s) in self.series.iter().enumerate() {
            let color = PALETTE[k % PALETTE.len()];
            let pts: Vec<(i64, i64)> = s
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .map(|&(x, y)| (px(x), py(y)))
                .collect();
            for w in pts.windows(2) {
                c.line(w[0], w[1], color, 2);
            }
            if pts.len() == 1 {
                c.fill_rect(pts[0].0 - 2, pts[0].1 - 2, 5, 5, color);
            }
            if self.series.len() > 1 {
                let ly = top + 4 + 12 * k as i64;
                c.fill_rect(left + pw - 120, ly + 2, 10, 3, color);
                c.text(left + pw - 106, ly, &s.name, INK, 1);
            }
        }
        c
    }
}

/// Several panels in a grid, `cols` wide, each `panel_w` x `panel_h`.
pub fn grid(panels: &[Canvas], cols: usize) -> Canvas {
    let cols = cols.max(1);
    let (pw, ph) = panels
        .first()
        .map(|p| (p.width(), p.height()))
        .unwrap_or((1, 1));
    let rows = panels.len().div_ceil(cols).max(1);
    let mut c = Canvas::new(pw * cols.min(panels.len().max(1)), ph * rows);
    for (i, p) in panels.iter().enumerate() {
        c.blit(p, (i % cols) * pw, (i / cols) * ph);
    }
    c
}

/// A grouped bar chart: for each category, one bar per series.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BarChart {
    /// Title above the plot.
    pub title: String,
    /// Label of the y axis (drawn under the title).
    pub y_label: String,
    /// Category labels along the x axis.
    pub categories: Vec<String>,
    /// (legend name, one value per category).
    pub series: Vec<(String, Vec<f64>)>,
}

/// Width of a legend entry's swatch and the gap after it.
const SWATCH: i64 = 8;
const SWATCH_GAP: i64 = 6;
/// Gap between legend entries.
const ENTRY_GAP: i64 = 14;

impl BarChart {
    /// Width of the legend's one row (0 without a legend: a single series needs none).
    fn legend_width(&self) -> i64 {
        if self.series.len() < 2 {
            return 0;
        }
        self.series
            .iter()
            .map(|(name, _)| SWATCH + SWATCH_GAP + Canvas::text_width(name, 1))
            .sum::<i64>()
            + ENTRY_GAP * (self.series.len() as i64 - 1)
    }

    /// The plot area (left, top, width, height) on a `width` x `height` canvas. The legend
    /// sits above it, never over the bars: on the y label's row, right-aligned, where both
    /// fit, else on a row of its own.
    pub fn plot_area(&self, width: usize, height: usize) -> (i64, i64, i64, i64) {
        let (left, right, bottom) = (70i64, 12i64, 30i64);
        let pw = width as i64 - left - right;
        let legend = self.legend_width();
        let shares_row = legend == 0 || Canvas::text_width(&self.y_label, 1) + 16 + legend <= pw;
        let top = if shares_row { 44 } else { 58 };
        (left, top, pw, height as i64 - top - bottom)
    }

    /// Draws the chart on a `width` x `height` canvas.
    pub fn render(&self, width: usize, height: usize) -> Canvas {
        let mut c = Canvas::new(width, height);
        let (left, top, pw, ph) = self.plot_area(width, height);
        c.text(left, 8, &self.title, INK, 2);
        c.text(left, 28, &self.y_label, INK, 1);
        let vals = self
            .series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .filter(|v| v.is_finite());
        let ymax = vals.fold(0.0f64, f64::max).max(1e-12) * 1.1;
        let py = |y: f64| top + ph - (y / ymax * ph as f64).round() as i64;
        for k in 0..=4 {
            let yv = ymax * k as f64 / 4.0;
            let y = py(yv);
            c.line((left, y), (left + pw, y), GRID, 1);
            let label = tick_label(yv);
            c.text(
                left - 6 - Canvas::text_width(&label, 1),
                y - 3,
                &label,
                INK,
                1,
            );
        }
        let n = self.categories.len().max(1) as i64;
        let group = pw / n;
        let nser = self.series.len().max(1) as i64;
        let bar = ((group - 8) / nser).max(1);
        for (ci, cat) in self.categories.iter().enumerate() {
            let gx = left + ci as i64 * group + 4;
            for (si, (_, v)) in self.series.iter().enumerate() {
                let val = v.get(ci).copied().unwrap_or(0.0);
                if !val.is_finite() || val <= 0.0 {
                    continue;
                }
                let y = py(val);
                c.fill_rect(
                    gx + si as i64 * bar,
                    y,
                    bar - 1,
                    top + ph - y,
                    PALETTE[si % PALETTE.len()],
                );
            }
            let lw = Canvas::text_width(cat, 1);
            if lw <= group {
                c.text(gx + (group - 8) / 2 - lw / 2, top + ph + 6, cat, INK, 1);
            }
        }
        c.line((left, top), (left, top + ph), INK, 1);
        c.line((left, top + ph), (left + pw, top + ph), INK, 1);
        let legend = self.legend_width();
        if legend > 0 {
            // On the y label's row when it fits there (top is 44), else the row below it.
            let ly = if top > 44 { 42 } else { 28 };
            let mut x = (left + pw - legend).max(left);
            for (k, (name, _)) in self.series.iter().enumerate() {
                c.fill_rect(x, ly, SWATCH, SWATCH, PALETTE[k % PALETTE.len()]);
                x += SWATCH + SWATCH_GAP;
                c.text(x, ly, name, INK, 1);
                x += Canvas::text_width(name, 1) + ENTRY_GAP;
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_chart_draws_its_series_and_encodes_png() {
        let chart = LineChart {
            title: "reward".into(),
            x_label: "step".into(),
            series: vec![Series {
                name: "mean".into(),
                points: (0..10).map(|i| (i as f64, (i * i) as f64)).collect(),
            }],
        };
        let c = chart.render(320, 200);
        let colored = (0..c.height())
            .flat_map(|y| (0..c.width()).map(move |x| (x, y)))
            .filter(|&(x, y)| c.pixel(x, y) == PALETTE[0])
            .count();
        assert!(colored > 100, "the curve is drawn ({colored} pixels)");
        let png = c.to_png().unwrap();
        assert_eq!(&png[1..4], b"PNG");
    }

    #[test]
    fn empty_and_flat_data_do_not_panic() {
        let empty = LineChart {
            title: "x".into(),
            ..Default::default()
        };
        empty.render(200, 120);
        let flat = LineChart {
            series: vec![Series {
                name: "a".into(),
                points: vec![(1.0, 2.0)],
            }],
            ..Default::default()
        };
        flat.render(200, 120);
        let bars = BarChart {
            categories: vec!["L1".into()],
            series: vec![("s".into(), vec![f64::NAN])],
            ..Default::default()
        };
        bars.render(200, 120);
    }

    #[test]
    fn bars_scale_to_the_largest_value() {
        let bars = BarChart {
            categories: vec!["a".into(), "b".into()],
            series: vec![("s".into(), vec![1.0, 2.0])],
            ..Default::default()
        };
        let c = bars.render(300, 200);
        let height_of = |x: usize| {
            (0..c.height())
                .filter(|&y| c.pixel(x, y) == PALETTE[0])
                .count()
        };
        let group = (300 - 70 - 12) / 2;
        let a = height_of(70 + 4 + 5);
        let b = height_of(70 + group + 4 + 5);
        assert!(
            b > a && (b as f64 / a as f64 - 2.0).abs() < 0.1,
            "bar heights {a} and {b}"
        );
    }
}
