"""Example analysis: US macroeconomic data (statsmodels' macrodata, 1959Q1-2009Q3).

Run with:  sandq run --upload examples/macrodata.csv examples/macro_summary.py
Prints a summary table and one machine-readable STATS line, and saves macro.png (800x400 px).
"""
import json

import matplotlib.pyplot as plt
import pandas as pd

df = pd.read_csv("macrodata.csv")
df["period"] = df["year"].astype(str) + "Q" + df["quarter"].astype(str)

print(f"{len(df)} quarters, {df['period'].iloc[0]} to {df['period'].iloc[-1]}")
print(df[["realgdp", "unemp", "infl", "tbilrate"]].describe().round(2).to_string())

peak = df.loc[df["unemp"].idxmax()]
stats = {
    "rows": int(len(df)),
    "realgdp_mean": round(float(df["realgdp"].mean()), 6),
    "realgdp_growth_pct": round(float(df["realgdp"].iloc[-1] / df["realgdp"].iloc[0] * 100 - 100), 6),
    "unemp_max": float(peak["unemp"]),
    "unemp_max_period": peak["period"],
    "infl_mean": round(float(df["infl"].mean()), 6),
}
print("STATS " + json.dumps(stats, sort_keys=True))

fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
ax.plot(df["year"] + (df["quarter"] - 1) / 4, df["realgdp"], color="tab:blue")
ax.set_ylabel("real GDP (billions of 2005 USD)", color="tab:blue")
ax2 = ax.twinx()
ax2.plot(df["year"] + (df["quarter"] - 1) / 4, df["unemp"], color="tab:red")
ax2.set_ylabel("unemployment (%)", color="tab:red")
ax.set_title("US real GDP and unemployment, 1959-2009")
fig.tight_layout()
fig.savefig("macro.png")
print("saved macro.png")

# In notebook mode (the default), the last expression comes back as a table (HTML and
# markdown), and the figure left open as a PNG output.
df[["period", "realgdp", "unemp", "infl"]].tail(4)
