"""The sandbox image's Python toolbox: every module a job may import (docs/sandbox-image.md).

Run at image build (a broken image never lands in the cache) and by tests/toolbox.rs through a
real worker. Prints `ok <module> <version>` per module, then `imported <n>`; raises on the first
missing one.
"""
import importlib
import warnings

MODULES = [
    "pandas", "numpy", "scipy", "statsmodels", "matplotlib", "seaborn", "plotly", "sklearn",
    "xgboost", "requests", "bs4", "httpx", "openpyxl", "docx", "pypdf", "PyPDF2", "PIL",
    "IPython", "jinja2", "markdown", "weasyprint", "reportlab", "fpdf", "sympy", "tabulate",
    "tqdm", "xlrd", "pyarrow", "pyarrow.parquet", "networkx", "skimage", "cv2", "nltk",
    "imageio", "xarray", "aiohttp", "pytz", "joblib", "soundfile", "ipykernel", "jupyter_client", "zmq",
]

warnings.simplefilter("ignore")
for name in MODULES:
    module = importlib.import_module(name)
    version = getattr(module, "__version__", None) or getattr(module, "VERSION", "")
    print("ok", name, version)
print("imported", len(MODULES))
