//! A session's cells against the same cells in one Jupyter kernel (issue 21): each case runs its
//! 3 to 5 cells as notebook jobs of a new sandq session (a sandbox per cell, the state carried
//! between them), and again in one job that starts an IPython kernel with `jupyter_client` on
//! the same image and executes the cells in it, one after the other. What each cell prints must
//! be the same. The kernel is the reference: it never leaves its process, so it keeps
//! everything; the session must give the cells the same values. Real sizes: a 200,000-row CSV
//! uploaded, a fitted scikit-learn model, a dict of DataFrames, a class with a method, a
//! closure, lambdas in a list, a figure with two axes.

use sandq_schemas::{InputFile, JobResult, JobStatus, RunMode, Sku};
use sandq_tests::{client, python_job, run};
use std::fmt::Write as _;

/// Runs `cells` in one kernel (`jupyter_client`, IPC transport inside the sandbox) in one script
/// job with `inputs`; returns each cell's stdout, or `!<ename>` for a cell that raised.
async fn in_one_kernel(cells: &[&str], inputs: &[InputFile]) -> Vec<String> {
    let cells_json = serde_json::to_string(&serde_json::to_string(cells).expect("json")).expect("json");
    let code = format!(
        r#"
import json, os, sys
os.environ["JUPYTER_RUNTIME_DIR"] = "/tmp/jupyter-runtime"
os.environ["IPYTHONDIR"] = "/tmp/ipython"
from jupyter_client.manager import KernelManager
cells = json.loads({cells_json})
km = KernelManager(kernel_name="python3", transport="ipc", ip="/tmp/kernel-ipc")
km.start_kernel(cwd="/work")
kc = km.client()
kc.start_channels()
kc.wait_for_ready(timeout=120)
out = []
try:
    for cell in cells:
        texts, errors = [], []
        def hook(msg):
            kind = msg["msg_type"]
            if kind == "stream" and msg["content"]["name"] == "stdout":
                texts.append(msg["content"]["text"])
            elif kind == "error":
                errors.append(msg["content"]["ename"])
        reply = kc.execute_interactive(cell, output_hook=hook, timeout=120)
        out.append("!" + errors[0] if errors else "".join(texts))
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
print("KERNEL " + json.dumps(out))
"#
    );
    let mut spec = python_job(&code, Sku::M);
    spec.mode = Some(RunMode::Script);
    spec.timeout = Some("300s".into());
    spec.inputs = inputs.to_vec();
    let mut client = client().await;
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "the kernel job: {}\n{result:?}", result.stderr.text);
    let line = result.stdout.text.lines().find_map(|l| l.strip_prefix("KERNEL ")).unwrap_or_else(|| panic!("no kernel line: {result:?}"));
    serde_json::from_str(line).expect("the kernel's outputs")
}

/// Runs `cells` as notebook jobs of one new sandq session (the first with `inputs`); returns each
/// cell's stdout, or `!<ename>`, and the results.
async fn in_a_session(cells: &[&str], inputs: &[InputFile]) -> (Vec<String>, Vec<JobResult>) {
    let session = format!("kernel-{}", uuid::Uuid::new_v4().simple());
    let mut client = client().await;
    let mut out = Vec::new();
    let mut results = Vec::new();
    for (n, cell) in cells.iter().enumerate() {
        let mut spec = python_job(cell, Sku::M);
        spec.session = Some(session.clone());
        spec.timeout = Some("300s".into());
        if n == 0 {
            spec.inputs = inputs.to_vec();
        }
        let result = run(&mut client, &spec).await;
        assert!(matches!(result.status, JobStatus::Succeeded | JobStatus::Failed), "cell {}: {result:?}", n + 1);
        let state = result.session.as_ref().and_then(|s| s.state.clone());
        assert!(
            state.as_ref().is_some_and(|s| s.unsaved.is_empty() && s.not_restored.is_empty()),
            "cell {}: the session kept everything: {state:?}",
            n + 1
        );
        out.push(match &result.error {
            Some(e) => format!("!{}", e.name),
            None => result.stdout.text.clone(),
        });
        results.push(result);
    }
    (out, results)
}

/// The same cells in a session and in one kernel print the same.
async fn same_as_a_kernel(case: &str, cells: &[&str], inputs: &[InputFile]) -> Vec<String> {
    let (session, _) = in_a_session(cells, inputs).await;
    let kernel = in_one_kernel(cells, inputs).await;
    assert_eq!(session, kernel, "{case}: the session's cells (left) against one kernel's (right)");
    assert!(kernel.iter().all(|c| !c.starts_with('!')), "{case}: no cell raised in the kernel: {kernel:?}");
    kernel
}

#[tokio::test]
async fn a_200000_row_csv_uploaded_then_worked_on_over_cells() {
    // Rows of a seeded linear congruential generator, written and summed here, independently of
    // both runs.
    let mut state: u64 = 2026;
    let mut next = || {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % 1000
    };
    let mut csv = String::from("id,region,qty\n");
    let mut total: u64 = 0;
    let mut by_region = [0u64; 4];
    let mut over_500 = 0usize;
    for id in 0..200_000u64 {
        let (region, qty) = (next() % 4, next());
        total += qty;
        over_500 += usize::from(qty > 500);
        by_region[region as usize] += qty;
        writeln!(csv, "{id},r{region},{qty}").expect("write");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sales.csv");
    std::fs::write(&path, &csv).expect("csv");
    let input = client().await.upload(&path, "sales.csv").await.expect("upload");
    let cells = [
        "import pandas as pd\ndf = pd.read_csv('sales.csv')\nprint(df.shape)",
        "df['double'] = df.qty * 2\nbig = df[df.qty > 500]\nprint(int(df.double.sum()), len(big) <= len(df))",
        "by = df.groupby('region').qty.sum()\nprint({k: int(v) for k, v in by.items()})",
        "print(big.index.equals(df[df.qty > 500].index), int(df.qty.sum()))",
        // After a cell that only read (its state not stored again), the state of the one before.
        "print(list(df.columns), len(big))",
    ];
    let out = same_as_a_kernel("csv", &cells, &[input]).await;
    assert_eq!(out[0], "(200000, 3)\n");
    assert_eq!(out[1], format!("{} True\n", 2 * total));
    let regions: Vec<String> = (0..4).map(|r| format!("'r{r}': {}", by_region[r])).collect();
    assert_eq!(out[2], format!("{{{}}}\n", regions.join(", ")));
    assert_eq!(out[3], format!("True {total}\n"));
    assert_eq!(out[4], format!("['id', 'region', 'qty', 'double'] {over_500}\n"));
}

#[tokio::test]
async fn a_fitted_model_a_dict_of_frames_a_class_a_closure_and_lambdas_carry_over() {
    let cells = [
        // A model fitted on exact data (y = 3 x0 - 2 x1 + 5), frames sharing one object.
        "import numpy as np, pandas as pd\nfrom sklearn.linear_model import LinearRegression\n\
         X = np.arange(40, dtype=float).reshape(20, 2)\nX[:, 1] = X[:, 1] ** 1.5\ny = 3 * X[:, 0] - 2 * X[:, 1] + 5\n\
         model = LinearRegression().fit(X, y)\n\
         frames = {k: pd.DataFrame({'v': np.arange(5) * i}) for i, k in enumerate('abc')}\nfirst = frames['a']\n\
         class Counter:\n    def __init__(self):\n        self.n = 0\n    def bump(self, by=1):\n        self.n += by * step\n        return self.n\n\
         step = 1\n\
         def make(k):\n    def f(x):\n        return x * k + offset\n    return f\n\
         offset = 0\nfns = [lambda x, i=i: x + i for i in range(3)] + [lambda x: x * scale]\nscale = 5\n\
         print(np.round(model.coef_, 6).tolist(), round(float(model.intercept_), 6))",
        "c = Counter()\nc.bump()\nstep = 10\ng = make(3)\noffset = 100\nscale = 7\nframes['b'].loc[0, 'v'] = 99\nfirst['v'] += 1\n\
         print(c.bump(), g(2), [f(1) for f in fns])",
        "print(model.predict(np.array([[1.0, 8.0]])).round(6).tolist(), {k: int(f.v.sum()) for k, f in frames.items()}, first is frames['a'])",
        "c.bump(2)\nprint(c.n, isinstance(c, Counter), type(c).bump is Counter.bump, g(1), fns[-1](2))",
    ];
    let out = same_as_a_kernel("objects", &cells, &[]).await;
    // Computed here: the exact fit, Counter 1 + 10, make(3)(2) + 100, the lambdas with scale 7.
    assert_eq!(out[0], "[3.0, -2.0] 5.0\n");
    assert_eq!(out[1], "11 106 [1, 2, 3, 7]\n");
    // 3 * 1 - 2 * 8 + 5; a: 0..4 each + 1; b: 99 + 1 + 2 + 3 + 4; c: 2 * (0 + 1 + 2 + 3 + 4).
    assert_eq!(out[2], "[-8.0] {'a': 5, 'b': 109, 'c': 20} True\n");
    assert_eq!(out[3], "31 True True 103 14\n");
}

#[tokio::test]
async fn a_figure_with_two_axes_is_one_figure_over_cells() {
    let cells = [
        "import matplotlib.pyplot as plt\nfig, (left, right) = plt.subplots(1, 2, figsize=(8, 3))\nleft.plot([1, 2, 3])\nprint(len(fig.axes))",
        "right.set_title('right side')\nleft.set_xlabel('x')\nright.bar(['a', 'b'], [3, 4])\nprint(right.figure is fig, left.figure is right.figure)",
        "fig.set_size_inches(10, 4)\nprint(len(fig.axes), fig.axes[1].get_title(), fig.axes[0].get_xlabel(), fig.axes[0] is left, \
         len(left.lines), len(right.patches), fig.get_size_inches().tolist())",
    ];
    let out = same_as_a_kernel("figure", &cells, &[]).await;
    assert_eq!(out[2], "2 right side x True 1 2 [10.0, 4.0]\n");
}
