//! The bar chart's layout: what it draws stays where a reader can see it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use charts::{BarChart, INK, PALETTE};

#[test]
fn the_legend_stays_clear_of_the_bars() {
    for y_label in ["x".to_string(), "a long label of the y axis ".repeat(4)] {
        let bars = BarChart {
            title: "speedup".into(),
            y_label: y_label.clone(),
            categories: vec!["#0".into(), "#1".into(), "#2".into()],
            series: vec![
                ("eager".into(), vec![1.0, 1.0, 1.0]),
                ("ModelNew".into(), vec![3.0, 3.0, 3.0]),
            ],
        };
        let (w, h) = (400, 240);
        let c = bars.render(w, h);
        let (left, top, pw, ph) = bars.plot_area(w, h);
        // Inside the plot (axes excluded) there are bars and grid lines, no ink: no legend
        // text over the bars.
        for y in top..top + ph {
            for x in left + 1..left + pw {
                assert_ne!(c.pixel(x as usize, y as usize), INK, "ink at ({x}, {y})");
            }
        }
        // The legend is drawn: both swatches above the plot.
        for (k, colour) in PALETTE.iter().take(2).enumerate() {
            let above = (0..top as usize)
                .flat_map(|y| (0..w).map(move |x| (x, y)))
                .any(|(x, y)| c.pixel(x, y) == *colour);
            assert!(above, "swatch {k} above the plot ({y_label:?})");
        }
    }
}

#[test]
fn a_single_series_has_no_legend() {
    let bars = BarChart {
        title: "time".into(),
        y_label: "ms".into(),
        categories: vec!["eager".into(), "ModelNew".into()],
        series: vec![("time".into(), vec![2.0, 1.0])],
    };
    let c = bars.render(300, 200);
    let (_, top, _, _) = bars.plot_area(300, 200);
    let above = (0..top as usize)
        .flat_map(|y| (0..300).map(move |x| (x, y)))
        .any(|(x, y)| c.pixel(x, y) == PALETTE[0]);
    assert!(!above, "no swatch for a single series");
}
