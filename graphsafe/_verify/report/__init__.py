"""The report of `graphsafe verify`: its rows, how a refit and the run are judged, and how
it reads (an error quoted in a line, the table)."""
