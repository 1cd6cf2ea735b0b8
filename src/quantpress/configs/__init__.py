"""Data, not code: GGUF type policies and option tables, read with importlib.resources."""
from importlib import resources
import tomllib


def load_toml(name: str) -> dict:
    """Parse ``configs/<name>`` (a TOML file shipped with the package)."""
    return tomllib.loads(resources.files(__name__).joinpath(name).read_text(encoding="utf-8"))
