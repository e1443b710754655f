"""This project's handlers: every module here is served (`thaw serve`, `thaw invoke`)."""
