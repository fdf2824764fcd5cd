"""Reads co2.csv and co2.jsonl (weekly Mauna Loa CO2 in ppm, 1958-2001, with gaps).

Run with:  sandq run --upload examples/data/co2.csv --upload examples/data/co2.jsonl examples/read_co2.py
Prints key=value lines for each file (prefix csv. and jsonl.): the number of weeks, of missing
values, the longest run of consecutive missing weeks, the date range, and the mean, minimum and
maximum CO2; then whether both files hold the same series.
"""
import pandas as pd


def summary(prefix, df):
    missing = df["co2"].isna()
    longest = run = 0
    for gap in missing:
        run = run + 1 if gap else 0
        longest = max(longest, run)
    print(f"{prefix}.rows={len(df)}")
    print(f"{prefix}.missing={int(missing.sum())}")
    print(f"{prefix}.longest_gap={longest}")
    print(f"{prefix}.first_date={df['date'].iloc[0]}")
    print(f"{prefix}.last_date={df['date'].iloc[-1]}")
    print(f"{prefix}.mean={float(df['co2'].mean())!r}")
    print(f"{prefix}.min={float(df['co2'].min())!r}")
    print(f"{prefix}.max={float(df['co2'].max())!r}")


csv = pd.read_csv("co2.csv", dtype={"date": str}, float_precision="round_trip")
jsonl = pd.read_json("co2.jsonl", lines=True, dtype={"date": str, "co2": float}, convert_dates=False)
summary("csv", csv)
summary("jsonl", jsonl)
same = csv["date"].equals(jsonl["date"]) and csv["co2"].equals(jsonl["co2"])
print(f"same_series={same}")
