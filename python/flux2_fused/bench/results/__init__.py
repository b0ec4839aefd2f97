"""What each benchmark command and `verify` report, a module a command: its result types (their
fields are the JSON fields, each documented on its class) and its tables. `tables` holds what they
share: the markdown table, the paired timings, the kernel breakdown, the JSON file.

No torch here: the plot and the formatters need only the figures, so drawing or printing a report
never imports a model, and the benchmark modules and the plot share these types without importing
each other.
"""
