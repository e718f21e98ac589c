"""Which GPU to rent: the catalogue, the estimator, the `usecases advise` report."""
