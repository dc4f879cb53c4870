"""mkdocs hook (mkdocs.yml ``hooks:``): the configuration reference page, generated from the config
dataclasses each time the site is built, so it cannot drift from the code (k3jax/config/reference.py)."""

from mkdocs.structure.files import File

from k3jax.config.reference import config_reference


def on_files(files, config):
    files.append(File.generated(config, "reference/config.md", content=config_reference()))
    return files
