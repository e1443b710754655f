"""Handler modules: the shipped examples, and where users add theirs."""
