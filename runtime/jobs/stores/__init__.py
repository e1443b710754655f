"""Job store implementations (SQLite for local, DynamoDB + S3 on AWS) of
runtime.jobs.store.JobStore. May import runtime.jobs.job and below."""
