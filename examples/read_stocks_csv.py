"""Reads Stocks.csv (monthly prices of 10 tickers, 1990-2019; matplotlib sample data).

Run with:  sandq run --upload examples/data/Stocks.csv examples/read_stocks_csv.py
The first line is a '#' comment; empty cells are missing prices (NaN). Prints key=value lines:
the number of rows, of rows without any price, the date range, and per ticker the number of
prices, their mean, minimum and maximum.
"""
import pandas as pd

# float_precision="round_trip": parse each price to the nearest double, as Python's float() does
# (pandas' default parser is faster but may be off by one unit in the last place).
df = pd.read_csv("Stocks.csv", comment="#", dtype={"Date": str}, float_precision="round_trip")
tickers = [c for c in df.columns if c != "Date"]
prices = df[tickers]

print(f"rows={len(df)}")
print(f"empty_rows={int(prices.isna().all(axis=1).sum())}")
print(f"first_date={df['Date'].iloc[0]}")
print(f"last_date={df['Date'].iloc[-1]}")
print(f"tickers={','.join(tickers)}")
for t in tickers:
    column = prices[t]
    print(f"count.{t}={int(column.count())}")
    print(f"mean.{t}={float(column.mean())!r}")
    print(f"min.{t}={float(column.min())!r}")
    print(f"max.{t}={float(column.max())!r}")
