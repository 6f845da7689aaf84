"""Map the top-level folders onto the `textgen` import namespace.

`service/` is `textgen.service`, `sdk/` is `textgen.sdk`, `envoy/` is `textgen.envoy`.
pyproject.toml holds everything else; this file only lists the packages, which
setuptools' declarative config cannot find under a renamed prefix.
"""

from setuptools import find_packages, setup

FOLDERS = {"textgen.service": "service", "textgen.sdk": "sdk", "textgen.envoy": "envoy"}


def packages(prefix: str, folder: str) -> list[str]:
    return [prefix] + [f"{prefix}.{sub}" for sub in find_packages(folder)]


setup(
    packages=[p for prefix, folder in FOLDERS.items() for p in packages(prefix, folder)],
    package_dir=FOLDERS,
    package_data={
        "textgen.envoy": ["*.binpb", "*.yaml", "*.json"],
        "textgen.service.proto": ["*.pyi"],
        "textgen.service.engine.attention": ["*.cpp"],
        "textgen.sdk": ["py.typed"],
        "textgen.sdk._generated": ["py.typed"],
    },
)
