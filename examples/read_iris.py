"""Reads iris.csv (Fisher's iris as bundled with scikit-learn).

Run with:  sandq run --upload examples/data/iris.csv examples/read_iris.py
The header row is not column names but "150,4,setosa,versicolor,virginica": the number of
samples, of features, and the class names; the last column is the class as 0/1/2. Prints
key=value lines: the header's counts and names, and per class its sample count and the mean
of each feature.
"""
import pandas as pd

with open("iris.csv", encoding="utf-8") as f:
    header = f.readline().strip().split(",")
n_samples, n_features, classes = int(header[0]), int(header[1]), header[2:]
features = ["sepal_length", "sepal_width", "petal_length", "petal_width"][:n_features]
df = pd.read_csv("iris.csv", skiprows=1, header=None, names=features + ["target"], float_precision="round_trip")
df["species"] = df["target"].map(dict(enumerate(classes)))

print(f"header_samples={n_samples}")
print(f"header_features={n_features}")
print(f"classes={','.join(classes)}")
print(f"rows={len(df)}")
for name, group in df.groupby("species", sort=False):
    print(f"count.{name}={len(group)}")
    for feature in features:
        print(f"mean.{name}.{feature}={float(group[feature].mean())!r}")
