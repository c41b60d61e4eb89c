module github.com/pal-sandbox/pal/sdk/go

go 1.19
