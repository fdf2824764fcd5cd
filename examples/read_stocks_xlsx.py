"""Reads stocks.xlsx (Stocks.csv as an Excel workbook, sheet "monthly").

Run with:  sandq run --upload examples/data/stocks.xlsx examples/read_stocks_xlsx.py
Empty cells are missing prices (NaN). Prints the same key=value lines as read_stocks_csv.py,
so the two files can be compared.
"""
import pandas as pd

df = pd.read_excel("stocks.xlsx", sheet_name="monthly", engine="openpyxl", dtype={"Date": str})
tickers = [c for c in df.columns if c != "Date"]
prices = df[tickers].astype(float)

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
