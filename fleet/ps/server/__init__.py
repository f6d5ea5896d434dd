"""The parameter-server process: its event loop and the tables it serves."""
