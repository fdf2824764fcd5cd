"""Reads a plain-text file, README-data.txt (the description of the example data sets).

Run with:  sandq run --upload examples/data/README-data.txt examples/read_text.py
Prints key=value lines like wc: bytes, characters, lines (newline characters), words
(whitespace-separated), the longest line's length, and how many lines are table rows
(starting with '|').
"""
with open("README-data.txt", "rb") as f:
    raw = f.read()
text = raw.decode("utf-8")
lines = text.splitlines()

print(f"bytes={len(raw)}")
print(f"chars={len(text)}")
print(f"lines={text.count(chr(10))}")
print(f"words={len(text.split())}")
print(f"longest_line={max(len(line) for line in lines)}")
print(f"table_rows={sum(1 for line in lines if line.startswith('|'))}")
