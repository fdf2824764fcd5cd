//! Chart data (issue 9, section 5): next to each matplotlib figure's PNG, what the figure
//! shows as `application/vnd.sandq.chart+json`, in E2B's `chart` shape, checked against the
//! values each test plotted. Real worker and containers.

use sandq_schemas::{JobStatus, Output, Sku};
use sandq_tests::{client, python_job, run};
use serde_json::{json, Value};

const CHART: &str = "application/vnd.sandq.chart+json";

fn chart(output: &Output) -> Value {
    let text = output.data.get(CHART).and_then(|v| v.text.as_deref()).unwrap_or_else(|| panic!("no {CHART} in {:?}", output.data.keys()));
    serde_json::from_str(text).expect("chart JSON")
}

/// Runs a notebook cell that shows one figure per `plt.show()`, and returns each figure's chart.
async fn charts(code: &str, figures: usize) -> Vec<Value> {
    let mut client = client().await;
    let result = run(&mut client, &python_job(code, Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    let images: Vec<&Output> = result.outputs.iter().filter(|o| o.data.contains_key("image/png")).collect();
    assert_eq!(images.len(), figures, "{:?}", result.outputs);
    images.into_iter().map(chart).collect()
}

fn points(element: &Value) -> Vec<(f64, f64)> {
    element["points"].as_array().expect("points").iter().map(|p| (p[0].as_f64().expect("x"), p[1].as_f64().expect("y"))).collect()
}

#[tokio::test]
async fn line_scatter_and_log_charts_give_their_series_labels_and_scales() {
    let code = "\
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.plot([1, 2, 3, 4], [10, 20, 15, 30], label='revenue')
ax.plot([1, 2, 3, 4], [5, 6, 7, 8])
ax.set_title('Quarterly')
ax.set_xlabel('quarter')
ax.set_ylabel('amount (kEUR)')
ax.legend()
plt.show()
fig, ax = plt.subplots()
ax.scatter([0.5, 1.5, 2.5], [3, 1, 2], label='samples')
plt.show()
fig, ax = plt.subplots()
ax.plot([1, 10, 100, 1000], [2, 20, 200, 2000])
ax.set_yscale('log')
plt.show()
";
    let charts = charts(code, 3).await;
    let line = &charts[0];
    assert_eq!(line["type"], "line");
    assert_eq!(line["title"], "Quarterly");
    assert_eq!((&line["x_label"], &line["y_label"], &line["y_unit"]), (&json!("quarter"), &json!("amount (kEUR)"), &json!("kEUR")));
    assert_eq!(line["x_unit"], Value::Null);
    assert_eq!((&line["x_scale"], &line["y_scale"]), (&json!("linear"), &json!("linear")));
    let elements = line["elements"].as_array().expect("elements");
    assert_eq!(elements.len(), 2);
    assert_eq!(elements[0]["label"], "revenue");
    assert_eq!(points(&elements[0]), [(1.0, 10.0), (2.0, 20.0), (3.0, 15.0), (4.0, 30.0)]);
    assert_eq!(elements[1]["label"], "Line 1", "an unlabelled line is named as E2B names it");
    assert_eq!(points(&elements[1]), [(1.0, 5.0), (2.0, 6.0), (3.0, 7.0), (4.0, 8.0)]);
    let ticks = line["y_ticks"].as_array().expect("ticks");
    assert_eq!(ticks.len(), line["y_tick_labels"].as_array().expect("labels").len());

    let scatter = &charts[1];
    assert_eq!(scatter["type"], "scatter");
    assert_eq!(scatter["elements"][0]["label"], "samples");
    assert_eq!(points(&scatter["elements"][0]), [(0.5, 3.0), (1.5, 1.0), (2.5, 2.0)]);

    let log = &charts[2];
    assert_eq!(log["type"], "line");
    assert_eq!((&log["x_scale"], &log["y_scale"]), (&json!("linear"), &json!("log")));
    assert_eq!(points(&log["elements"][0]), [(1.0, 2.0), (10.0, 20.0), (100.0, 200.0), (1000.0, 2000.0)]);
}

#[tokio::test]
async fn bar_and_pie_charts_give_labels_and_values() {
    let code = "\
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.bar(['North', 'South', 'East'], [12, 8, 5], label='units')
ax.set_ylabel('units sold')
plt.show()
fig, ax = plt.subplots()
ax.barh(['a', 'b'], [3.5, 1.25])
plt.show()
fig, ax = plt.subplots()
ax.pie([1, 1, 2], labels=['cats', 'dogs', 'fish'])
ax.set_title('Pets')
plt.show()
";
    let charts = charts(code, 3).await;
    let bar = &charts[0];
    assert_eq!(bar["type"], "bar");
    assert_eq!(bar["y_label"], "units sold");
    let bars: Vec<(String, String, f64)> = bar["elements"]
        .as_array()
        .expect("elements")
        .iter()
        .map(|e| {
            (
                e["label"].as_str().expect("label").to_owned(),
                e["group"].as_str().expect("group").to_owned(),
                e["value"].as_f64().expect("value"),
            )
        })
        .collect();
    let expected: Vec<(String, String, f64)> =
        [("North", 12.0), ("South", 8.0), ("East", 5.0)].iter().map(|(l, v)| ((*l).to_owned(), "units".to_owned(), *v)).collect();
    assert_eq!(bars, expected);

    let barh = &charts[1];
    assert_eq!(barh["type"], "bar");
    let values: Vec<(String, f64)> = barh["elements"]
        .as_array()
        .expect("elements")
        .iter()
        .map(|e| (e["label"].as_str().expect("label").to_owned(), e["value"].as_f64().expect("value")))
        .collect();
    assert_eq!(values, [("a".to_owned(), 3.5), ("b".to_owned(), 1.25)]);
    assert_eq!(barh["elements"][0]["group"], "Group 0");

    let pie = &charts[2];
    assert_eq!((&pie["type"], &pie["title"]), (&json!("pie"), &json!("Pets")));
    let slices: Vec<(String, f64)> = pie["elements"]
        .as_array()
        .expect("elements")
        .iter()
        .map(|e| (e["label"].as_str().expect("label").to_owned(), e["angle"].as_f64().expect("angle")))
        .collect();
    // Angles in degrees, in proportion to the values 1:1:2.
    assert_eq!(slices, [("cats".to_owned(), 90.0), ("dogs".to_owned(), 90.0), ("fish".to_owned(), 180.0)]);
}

#[tokio::test]
async fn several_axes_make_a_superchart_and_a_figure_left_open_has_its_chart_too() {
    let code = "\
import matplotlib.pyplot as plt
fig, (left, right) = plt.subplots(1, 2)
left.plot([0, 1], [1, 3])
right.bar(['x'], [7])
fig.suptitle('Both')
";
    let charts = charts(code, 1).await;
    let chart = &charts[0];
    assert_eq!((&chart["type"], &chart["title"]), (&json!("superchart"), &json!("Both")));
    assert_eq!(chart["elements"][0]["type"], "line");
    assert_eq!(points(&chart["elements"][0]["elements"][0]), [(0.0, 1.0), (1.0, 3.0)]);
    assert_eq!(chart["elements"][1]["type"], "bar");
    assert_eq!(chart["elements"][1]["elements"][0]["value"], 7.0);
}

#[tokio::test]
async fn a_dataframe_comes_with_its_table_schema_capped_like_its_html() {
    let code = "\
import numpy as np
import pandas as pd
df = pd.DataFrame({'price': [1.5, np.nan, 3.0], 'item': ['a', 'b', None]}, index=pd.date_range('2024-01-01', periods=3, name='day'))
display(df)
display(pd.DataFrame({'n': range(100)}))
df['price']
";
    let mut client = client().await;
    let result = run(&mut client, &python_job(code, Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    let schemas: Vec<Value> = result
        .outputs
        .iter()
        .map(|o| {
            let text = o
                .data
                .get("application/vnd.dataresource+json")
                .and_then(|v| v.text.as_deref())
                .unwrap_or_else(|| panic!("no table schema in {:?}", o.data.keys()));
            serde_json::from_str(text).expect("schema JSON")
        })
        .collect();
    assert_eq!(schemas.len(), 3);
    let frame = &schemas[0];
    let fields: Vec<(&str, &str)> = frame["schema"]["fields"]
        .as_array()
        .expect("fields")
        .iter()
        .map(|f| (f["name"].as_str().expect("name"), f["type"].as_str().expect("type")))
        .collect();
    assert_eq!(fields, [("day", "datetime"), ("price", "number"), ("item", "string")]);
    assert_eq!(frame["schema"]["primaryKey"], json!(["day"]));
    let rows = frame["data"].as_array().expect("data");
    assert_eq!(rows.len(), 3);
    for (row, (day, price, item)) in rows.iter().zip([
        ("2024-01-01", json!(1.5), json!("a")),
        ("2024-01-02", Value::Null, json!("b")),
        ("2024-01-03", json!(3.0), Value::Null),
    ]) {
        assert!(row["day"].as_str().expect("day").starts_with(&format!("{day}T00:00:00")), "{row}");
        assert_eq!((&row["price"], &row["item"]), (&price, &item), "NaN and None are null: {row}");
    }

    // 100 rows: the 10 the HTML shows (pandas' min_rows), the first and last five.
    let index: Vec<u64> = schemas[1]["data"].as_array().expect("data").iter().map(|r| r["index"].as_u64().expect("index")).collect();
    assert_eq!(index, [0, 1, 2, 3, 4, 95, 96, 97, 98, 99]);
    assert_eq!(result.outputs[1].table.map(|t| t.rows), Some(100), "the table's true shape");

    // A Series (the cell's value) too.
    let series = &schemas[2];
    assert_eq!(series["schema"]["fields"][1]["name"], "price");
    assert_eq!(series["data"][1]["price"], Value::Null);
}

/// The `p` quantile of sorted `data`, interpolated linearly between ranks (numpy's default),
/// computed here.
fn quantile(data: &[f64], p: f64) -> f64 {
    let pos = p * (data.len() - 1) as f64;
    let (low, frac) = (pos.floor() as usize, pos - pos.floor());
    data[low] + (data[(low + 1).min(data.len() - 1)] - data[low]) * frac
}

#[tokio::test]
async fn a_box_plot_gives_quartiles_whiskers_and_outliers() {
    let groups: [(&str, Vec<f64>); 2] =
        [("north", vec![1.0, 2.0, 3.0, 4.0, 5.0, 20.0]), ("south", vec![100.0, 101.0, 102.0, 103.0, 140.0])];
    let lists: Vec<String> = groups.iter().map(|(_, v)| format!("{v:?}")).collect();
    let code = format!(
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.boxplot([{}], patch_artist=True, tick_labels=['north', 'south'])\nplt.show()\n",
        lists.join(", ")
    );
    let charts = charts(&code, 1).await;
    assert_eq!(charts[0]["type"], "box_and_whisker");
    for ((label, data), element) in groups.iter().zip(charts[0]["elements"].as_array().expect("elements")) {
        let (q1, median, q3) = (quantile(data, 0.25), quantile(data, 0.5), quantile(data, 0.75));
        // Whiskers reach the furthest points within 1.5 IQR of the box; the rest are outliers.
        let (low, high) = (q1 - 1.5 * (q3 - q1), q3 + 1.5 * (q3 - q1));
        let inside: Vec<f64> = data.iter().copied().filter(|v| (low..=high).contains(v)).collect();
        let outliers: Vec<f64> = data.iter().copied().filter(|v| !(low..=high).contains(v)).collect();
        assert_eq!(element["label"], *label);
        let got = |k: &str| element[k].as_f64().unwrap_or_else(|| panic!("{k} in {element}"));
        assert_eq!((got("first_quartile"), got("median"), got("third_quartile")), (q1, median, q3), "{element}");
        assert_eq!((got("min"), got("max")), (inside[0], inside[inside.len() - 1]), "{element}");
        let found: Vec<f64> = element["outliers"].as_array().expect("outliers").iter().filter_map(Value::as_f64).collect();
        assert_eq!(found, outliers, "{element}");
    }
}
