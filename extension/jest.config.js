// Unit tests of the pure modules (delta application, URL building): node, no DOM, no JupyterLab.
module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/test'],
  testMatch: ['**/*.test.ts'],
  transform: {
    '^.+\\.ts$': [
      'ts-jest',
      { tsconfig: '<rootDir>/tsconfig.test.json' }
    ]
  }
};
