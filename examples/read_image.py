"""Reads grace_hopper.jpg (matplotlib sample data) with Pillow.

Run with:  sandq run --upload examples/data/grace_hopper.jpg examples/read_image.py
Prints key=value lines: the format, width, height, mode, number of bands and pixels (decoding
the whole image), the resolution and the JPEG comment.
"""
from PIL import Image

with Image.open("grace_hopper.jpg") as img:
    img.load()
    print(f"format={img.format}")
    print(f"width={img.width}")
    print(f"height={img.height}")
    print(f"mode={img.mode}")
    print(f"bands={len(img.getbands())}")
    print(f"pixels={len(img.getdata())}")
    dpi = img.info.get("dpi")
    if dpi:
        print(f"dpi={round(float(dpi[0]))}x{round(float(dpi[1]))}")
    comment = img.info.get("comment")
    if comment:
        if isinstance(comment, bytes):
            comment = comment.decode("utf-8", "replace")
        print(f"comment={comment}")
