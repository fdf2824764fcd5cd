"""Reads co2_sample.json (a JSON array: the first 100 records of co2.jsonl).

Run with:  sandq run --upload examples/data/co2_sample.json examples/read_json.py
Prints key=value lines: the number of records, of null values, the date range, and the mean,
minimum and maximum CO2 of the non-null values.
"""
import json

import pandas as pd

with open("co2_sample.json", encoding="utf-8") as f:
    records = json.load(f)
df = pd.DataFrame.from_records(records)

print(f"records={len(records)}")
print(f"keys={','.join(sorted(records[0]))}")
print(f"nulls={int(df['co2'].isna().sum())}")
print(f"first_date={records[0]['date']}")
print(f"last_date={records[-1]['date']}")
print(f"mean={float(df['co2'].mean())!r}")
print(f"min={float(df['co2'].min())!r}")
print(f"max={float(df['co2'].max())!r}")
