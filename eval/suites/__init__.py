"""Shipped evaluation suites (`ladder eval --suite NAME`); a package so that installs carry them."""
