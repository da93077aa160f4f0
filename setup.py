"""Build hook: the C++ selection kernel is added here (see herald/csrc)."""

from setuptools import setup

setup()
