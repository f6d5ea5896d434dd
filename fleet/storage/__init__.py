"""Files that are never torn: atomic writes, and the one layout of numbered saves with a committed pointer."""
