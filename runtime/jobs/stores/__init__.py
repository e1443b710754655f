"""Job store implementations (SQLite for local, DynamoDB + S3 on AWS)."""
