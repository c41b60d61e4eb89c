"""Guest images: kernel + initramfs + rootfs built from Debian packages."""

from pal.images.builder import build_image
from pal.images.paths import ImageNotFound, ImagePaths, load_image

__all__ = ["ImageNotFound", "ImagePaths", "build_image", "load_image"]
