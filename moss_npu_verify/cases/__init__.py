"""Case handlers of the conformance runner, one module per part of the package they check."""
