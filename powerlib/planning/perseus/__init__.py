"""Perseus (SOSP'24): the exact iteration time-energy frontier of a pipeline by Phillips-Dessouky."""
