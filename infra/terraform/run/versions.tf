terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.0"
    }
  }
  # Each run gets its own workspace directory and local state, written by the orchestration's
  # TerraformNodeProvider; use a remote backend (S3 + DynamoDB lock) in production by adding a
  # backend block through -backend-config.
}

provider "aws" {
  region = var.region
}
