"""Draws ``examples/cat.png`` (a small cartoon cat face, 64 x 56 px) with PIL: the demo image of
``python infer.py --image examples/cat.png --prompt "Describe"``. Run it to regenerate the file."""

import pathlib

from PIL import Image, ImageDraw

SIZE = (64, 56)
FUR, EAR, EYE, NOSE, BG = (230, 140, 50), (250, 190, 170), (40, 120, 40), (200, 80, 100), (170, 210, 240)


def draw_cat() -> Image.Image:
    im = Image.new("RGB", SIZE, BG)
    d = ImageDraw.Draw(im)
    d.polygon([(12, 22), (16, 4), (28, 14)], fill=FUR)  # ears
    d.polygon([(52, 22), (48, 4), (36, 14)], fill=FUR)
    d.polygon([(15, 18), (17, 9), (24, 14)], fill=EAR)
    d.polygon([(49, 18), (47, 9), (40, 14)], fill=EAR)
    d.ellipse([10, 10, 54, 52], fill=FUR)  # head
    d.ellipse([20, 24, 28, 32], fill=EYE)
    d.ellipse([36, 24, 44, 32], fill=EYE)
    d.ellipse([23, 26, 25, 30], fill=(0, 0, 0))
    d.ellipse([39, 26, 41, 30], fill=(0, 0, 0))
    d.polygon([(29, 36), (35, 36), (32, 40)], fill=NOSE)
    for dy in (-2, 1, 4):  # whiskers
        d.line([(4, 38 + dy), (24, 39)], fill=(60, 40, 20))
        d.line([(60, 38 + dy), (40, 39)], fill=(60, 40, 20))
    return im


if __name__ == "__main__":
    out = pathlib.Path(__file__).resolve().parent / "cat.png"
    draw_cat().save(out, optimize=True)
    print(out, out.stat().st_size, "bytes")
